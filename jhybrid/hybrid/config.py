"""HybridConfig: the one switch that picks an attention mode and its GPU window / host policy.

Modes (shared/DESIGN.md "Modes"):
  full       all KV on the device (`jhybrid.attention.FullAttention`)
  recall     KV offloaded, then the whole offloaded KV is copied back to the device every step
  hgca       GPU window (+ sinks) dense; CPU attention over the MAW-selected offloaded tokens
  scout      GPU window + recalled important blocks; CPU attention over the other top-k blocks,
             submitted one layer ahead with a predicted query
  streaming  sinks + window only (offloaded KV is kept, never attended)
  topk       GPU window + a fixed budget of top-k offloaded blocks (exact query, CPU attention)

GPU window per layer and sequence: `sink` tokens (positions 0..sink-1, never evicted) plus a ring
of `window_tokens - sink` tokens in blocks of `block_size`. Offloaded tokens are never dropped.
"""

from __future__ import annotations

import dataclasses
import math

MODES = ("full", "recall", "hgca", "scout", "streaming", "topk")
HOST_MODES = ("recall", "hgca", "scout", "streaming", "topk")  # the modes that offload
EXCHANGES = ("split", "sync")
PREFILL_OFFLOADED = ("auto", "device", "host")


@dataclasses.dataclass(frozen=True)
class HybridConfig:
    """
    mode: one of MODES.
    window_tokens: GPU tokens per layer and sequence, sinks included (HGCA's window).
    block_size: tokens per eviction / selection block.
    sink: attention-sink tokens kept on the GPU forever.
    alpha: MAW moving-average factor, A = (1 - alpha) A + alpha A_new.
    beta: HGCA salience, keep an offloaded token for CPU attention iff MAW > beta / window_tokens.
        Tiny values (e.g. 1e-30) keep everything.
    topk_blocks: scout/topk budget in offloaded blocks per (sequence, KV head); None = every block.
    recall_blocks: scout: GPU slots per (layer, sequence) for recalled offloaded blocks.
    recall_threshold: scout: recall a layer's important blocks when the CPU's share of its selected
        blocks exceeds this (ScoutAttention's default 12%) ...
    recall_min_interval: ... but at most once every this many decode steps.
    predict_query: scout: CPU attention uses the layer-ahead predicted query (True, the paper's
        design, approximate) or the exact query submitted at the layer itself (False; exact).
    scout_exact_layers: scout with predict_query=True: the layers that use their exact query anyway
        (selection and CPU attention submitted at the layer itself, like topk) instead of the
        layer-ahead prediction. A tuple / list of layer indices, or an int N meaning layers 0..N-1.
        Layer 0 is always exact (nothing runs ahead of it), so () and 0 and 1 all mean "layer 0
        only" (the paper's design). Use it for layers whose predicted query is poor, e.g. SmolLM2's
        layers 1 and 2 (cosine predicted vs real query 0.23 and 0.67, measured with
        `python -m jhybrid.bench.query_similarity`). Cost: one extra callback per exact
        layer and decode step (L + |exact layers incl. 0| callbacks per step) and no layer-ahead
        overlap of those layers' CPU work. Indices >= the model's layer count are a ValueError when
        the cache is built. Ignored by modes other than scout (like predict_query).
    exchange: hgca: "split" = submit before the GPU window attention, collect after it (2 callbacks
        per layer, CPU overlaps the GPU); "sync" = one callback that computes on the spot.
    kernel_backend: pallas_kernels backend (None: triton on GPU, jnp reference elsewhere, logged).
    n_threads: Numba threads of the host worker (None: all cores but one).
    host_memory_cap_bytes: cap of the host store; a context that cannot fit is a ValueError.
    reevaluate_queries: hgca: how many of a new turn's last queries re-score the offloaded tokens.
    keep_after: hgca: each kept token also keeps the keep_after tokens after it (spans for copying;
        not in HGCA, whose rule is keep_after = 0; `host.sparsify.extend_spans`).
    prefill_offloaded: where a prefill / append chunk attends to the part of its sequence that is
        already offloaded: "device" = copy those blocks to the device before the chunk and attend
        there (`jhybrid.hybrid.prefill_upload`), "host" = CPU attention over the host store (every
        mode's decode-time path; slow for long chunks), "auto" = device on a GPU, host elsewhere.
    prefill_upload_max_bytes: "device" / "auto": a chunk whose copy (K + V of every layer, padded)
        would exceed this many bytes uses the host path instead (logged). None = no limit.
    """

    mode: str = "hgca"
    window_tokens: int = 1024
    block_size: int = 16
    sink: int = 16
    alpha: float = 0.1
    beta: float = 1.0
    topk_blocks: int | None = None
    recall_blocks: int = 8
    recall_threshold: float = 0.12
    recall_min_interval: int = 4
    predict_query: bool = True
    scout_exact_layers: tuple[int, ...] | int = ()
    exchange: str = "split"
    kernel_backend: str | None = None
    n_threads: int | None = None
    host_memory_cap_bytes: int | None = None
    reevaluate_queries: int = 16
    keep_after: int = 0
    prefill_offloaded: str = "auto"
    prefill_upload_max_bytes: int | None = 8 * 2**30

    def __post_init__(self):
        bad = []
        if self.mode not in MODES:
            raise ValueError(f"unknown attention mode {self.mode!r}; expected one of {', '.join(MODES)}")
        for name in ("window_tokens", "block_size", "recall_min_interval", "reevaluate_queries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                bad.append(f"{name}={value!r} (expected a positive int)")
        if not isinstance(self.sink, int) or self.sink < 0:
            bad.append(f"sink={self.sink!r} (expected an int >= 0)")
        if not bad:
            ring = self.window_tokens - self.sink
            if ring < self.block_size:
                bad.append(f"window_tokens={self.window_tokens} with sink={self.sink} leaves {ring} ring "
                           f"tokens: too small for one block of block_size={self.block_size}")
            elif ring % self.block_size:
                bad.append(f"window_tokens - sink = {ring} is not a multiple of block_size={self.block_size}")
        if not (isinstance(self.alpha, (int, float)) and 0.0 < self.alpha <= 1.0):
            bad.append(f"alpha={self.alpha!r} (expected a float in (0, 1])")
        if not (isinstance(self.beta, (int, float)) and 0.0 < self.beta < math.inf):
            bad.append(f"beta={self.beta!r} (expected a float in (0, inf))")
        if self.topk_blocks is not None and (not isinstance(self.topk_blocks, int) or self.topk_blocks < 1):
            bad.append(f"topk_blocks={self.topk_blocks!r} (expected None or an int >= 1)")
        if not isinstance(self.recall_blocks, int) or self.recall_blocks < 0:
            bad.append(f"recall_blocks={self.recall_blocks!r} (expected an int >= 0)")
        if not 0.0 <= self.recall_threshold <= 1.0:
            bad.append(f"recall_threshold={self.recall_threshold!r} (expected a fraction in [0, 1])")
        if isinstance(self.keep_after, bool) or not isinstance(self.keep_after, int) or self.keep_after < 0:
            bad.append(f"keep_after={self.keep_after!r} (expected an int >= 0)")
        if self.prefill_offloaded not in PREFILL_OFFLOADED:
            bad.append(f"prefill_offloaded={self.prefill_offloaded!r} (expected one of {PREFILL_OFFLOADED})")
        if self.prefill_upload_max_bytes is not None and (
                not isinstance(self.prefill_upload_max_bytes, int) or isinstance(self.prefill_upload_max_bytes, bool)
                or self.prefill_upload_max_bytes < 0):
            bad.append(f"prefill_upload_max_bytes={self.prefill_upload_max_bytes!r} (expected None or an int >= 0)")
        if self.exchange not in EXCHANGES:
            bad.append(f"exchange={self.exchange!r} (expected one of {EXCHANGES})")
        if self.kernel_backend not in (None, "triton", "interpret", "reference"):
            bad.append(f"kernel_backend={self.kernel_backend!r} (expected None, 'triton', 'interpret' or 'reference')")
        if self.host_memory_cap_bytes is not None and (not isinstance(self.host_memory_cap_bytes, int)
                                                       or self.host_memory_cap_bytes <= 0):
            bad.append(f"host_memory_cap_bytes={self.host_memory_cap_bytes!r} (expected None or a positive int)")
        exact = self.scout_exact_layers
        if isinstance(exact, list):
            exact = tuple(exact)
            object.__setattr__(self, "scout_exact_layers", exact)  # hashable: the config is a jit static
        if isinstance(exact, bool) or not isinstance(exact, (int, tuple)):
            bad.append(f"scout_exact_layers={exact!r} (expected a tuple of layer indices or an int N = "
                       "layers 0..N-1)")
        elif isinstance(exact, int) and exact < 0:
            bad.append(f"scout_exact_layers={exact!r} (expected an int N >= 0 = layers 0..N-1)")
        elif isinstance(exact, tuple):
            wrong = [x for x in exact if isinstance(x, bool) or not isinstance(x, int) or x < 0]
            if wrong:
                bad.append(f"scout_exact_layers={exact!r}: {', '.join(map(repr, wrong))} not a layer index "
                           "(expected ints >= 0)")
            elif len(set(exact)) != len(exact):
                bad.append(f"scout_exact_layers={exact!r} names a layer twice")
        if (self.mode == "scout" and not self.predict_query and not bad
                and self.exact_layer_set() - {0}):
            bad.append(f"scout_exact_layers={exact!r} with predict_query=False: every layer already uses "
                       "its exact query (set one of the two)")
        if bad:
            raise ValueError("invalid hybrid attention config: " + "; ".join(bad))

    # ---- derived sizes ---------------------------------------------------------------------
    @property
    def ring_tokens(self) -> int:
        """Non-sink GPU tokens (W of the ring buffer)."""
        return self.window_tokens - self.sink

    @property
    def blk_num(self) -> int:
        return self.ring_tokens // self.block_size

    @property
    def max_prefill_chunk(self) -> int:
        """Longest prefill chunk whose eviction never needs the chunk's own tokens (ring - 1 block)."""
        return max(1, self.ring_tokens - self.block_size)

    def host_blocks(self, max_len: int) -> int:
        """Upper bound on offloaded blocks per (layer, sequence) for a context of max_len tokens."""
        return max(1, -(-max(0, max_len - self.sink) // self.block_size))

    def uses_selection(self) -> bool:
        return self.mode in ("scout", "topk")

    def predicts(self) -> bool:
        return self.mode == "scout" and self.predict_query

    def exact_layer_set(self) -> frozenset:
        """scout_exact_layers as a set of layer indices (layer 0 always included)."""
        exact = self.scout_exact_layers
        return frozenset(range(max(exact, 1)) if isinstance(exact, int) else (0, *exact))

    def exact_query(self, layer: int) -> bool:
        """Does `layer` select and attend with its exact query (False: layer-ahead prediction)?"""
        return not self.predicts() or layer in self.exact_layer_set()

    def check_layers(self, num_layers: int) -> None:
        """ValueError when scout_exact_layers names a layer the model does not have."""
        if self.predicts():
            over = sorted(x for x in self.exact_layer_set() if x >= num_layers)
            if over:
                raise ValueError(f"scout_exact_layers={self.scout_exact_layers!r}: layer(s) "
                                 f"{', '.join(map(str, over))} out of range for a model of {num_layers} layers "
                                 f"(0..{num_layers - 1})")

    def pool_blocks(self) -> int:
        """GPU recall-pool slots per (layer, sequence) (scout only)."""
        return self.recall_blocks if self.mode == "scout" else 0


def evicted_blocks(n_tokens, cfg: HybridConfig):
    """Blocks evicted once a sequence holds n_tokens tokens (NumPy or jnp int arrays).

    The manager evicts just enough whole blocks, oldest first, before each write so that the ring
    never holds more than `ring_tokens` tokens; since tokens only grow, the count is a function of
    the length alone: e = max(0, ceil((n - sink - ring_tokens) / block_size)). Same policy as
    `host.eviction.plan_eviction` (HGCA Algorithm 1) — the device derives ring state from lengths.
    """
    over = n_tokens - cfg.sink - cfg.ring_tokens
    return (over + cfg.block_size - 1) // cfg.block_size * (over > 0)
