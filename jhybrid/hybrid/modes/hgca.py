"""`hgca` (HGCA): dense GPU attention over the window (+ sinks); CPU attention over the offloaded
tokens whose moving-average attention weight (MAW) passed beta / window_tokens when their block was
evicted (`host.sparsify`), with the exact query; the two partial states merged exactly.

Device side, per layer of a decode step:
    host_overlap (default): ticket = submit(q) -> window kernel (+ its probabilities for the MAW)
              -> collect -> merge (the CPU works while the GPU attends to the window)
    otherwise: the CPU part computed inside one exchange, then the window kernel
Host side: after every eviction, sparsify the evicted blocks of each layer (eviction thread);
before the first decode step of a turn, re-score every offloaded token with the turn's last
`reevaluate_queries` queries (`host.sparsify.reevaluate`): what HGCA does after each new user turn.
Every prefill chunk hands the tail of its queries to the host inside the step (`prefill_token` ->
`HgcaHost.receive_queries`), whichever path attends its offloaded prompt.
The CPU reads the kept tokens of the published blocks (`host.targets.KEPT_TOKENS`; the exchange
worker's `ContextPages`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from host.exchange_worker import ContextPages
from host.sparsify import reevaluate, sparsify_evicted
from host.targets import KEPT_TOKENS
from jhybrid.hybrid.exchange import after
from jhybrid.hybrid.modes.base import DecodeStep, HostLayout, ModeHost, OffloadMode, SplitBudget, Workload
from jhybrid.hybrid.runtime import Counters
from jhybrid.hybrid.state import LayerState
from jhybrid.hybrid.window import decode_attention, exact_window_attention


class Hgca(OffloadMode):
    name = "hgca"
    settings = frozenset({"alpha", "beta", "keep_after", "max_keep_share", "reevaluate_queries", "host_overlap"})
    host_target = KEPT_TOKENS
    reads_maw = True

    def decode(self, step: DecodeStep, state: LayerState):
        cfg, exchange = self.config, step.exchange
        if not cfg.host_overlap:
            cpu = exchange.attend_now(step.layer, KEPT_TOKENS, step.q)
            q = after(step.q, cpu[1])
            o_w, lse_w, probs = decode_attention(cfg, q, state.window, step.lengths, step.offloaded, step.scale)
            return [(o_w, lse_w), cpu], probs, state, None
        ticket = exchange.submit(step.layer, KEPT_TOKENS, step.q)
        q = after(step.q, ticket)
        o_w, lse_w, probs = decode_attention(cfg, q, state.window, step.lengths, step.offloaded, step.scale)
        return [(o_w, lse_w), exchange.collect(step.layer, ticket, q.shape, lse_w)], probs, state, None

    def prefill_token(self, layer, q, positions, exchange):
        return exchange.record_tail(layer, q, positions, self.config.reevaluate_queries)

    def host(self, context) -> "HgcaHost":
        return HgcaHost(context)

    # ---- around the core --------------------------------------------------------------------------
    def host_bytes_per_sequence(self, layout: HostLayout, offloaded_blocks, max_len, workload: Workload):
        """The store's blocks, plus the context cache's pages of the kept share (whole pages per
        (layer, KV head); a cap on the kept share bounds it)."""
        cfg = self.config
        kept = min(workload.kept_share, cfg.max_keep_share or 1.0) * offloaded_blocks * cfg.block_size
        pages = -(-int(kept) // layout.page_tokens)
        return layout.n_layers * (offloaded_blocks * layout.block_bytes + pages * layout.n_kv_heads * layout.page_bytes)

    def balanced(self, budget: SplitBudget) -> dict:
        """Cap the kept share at what the host attends in the GPU's time (a tighter given cap stays)."""
        if not budget.offloaded:
            return {}
        keep = min(1.0, budget.cpu_tokens / budget.offloaded)
        if keep >= 1.0:
            return {}
        cap = max(round(keep, 4), 1e-4)  # > 0: a share the config accepts
        return {"max_keep_share": cap if self.config.max_keep_share is None else min(cap, self.config.max_keep_share)}

    def restore_queries(self) -> int:
        return self.config.reevaluate_queries

    def restored_window(self, window, queries, n_tokens, evicted, scale):
        """The ring's MAW = the probabilities the history's last queries give it (so a ring token the
        first decode steps evict is judged by what the history attended, not dropped for a MAW of 0)."""
        if queries.shape[1] == 0:
            return window
        return _scored_ring(self.config, window, queries, n_tokens, evicted, scale)

    def row_fields(self) -> dict:
        cfg = self.config
        return {"beta": cfg.beta, **({"keep_after": cfg.keep_after} if cfg.keep_after else {}),
                **({"max_keep_share": cfg.max_keep_share} if cfg.max_keep_share is not None else {})}


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5))
def _scored_ring(cfg, window, q: jax.Array, n: int, evicted: int, scale: float):
    """The window with its ring MAW set to the probabilities of q [1, R, Hq, D] (the history's last R
    queries, positions n - R .. n - 1) over the sinks + ring (`exact_window_attention`'s probs)."""
    r = q.shape[1]
    positions = jnp.arange(n - r, n, dtype=jnp.int32)[None]
    _, _, probs = exact_window_attention(cfg, q, window, positions, jnp.full((1,), n, jnp.int32),
                                         jnp.full((1,), evicted, jnp.int32), scale)
    return window.replace(maw=probs)


@dataclasses.dataclass(eq=False)
class HgcaCounters(Counters):
    n_reevaluations: int = 0  # (layer) re-scorings of the offloaded tokens queued

    def __post_init__(self):
        Counters.__init__(self)


class HgcaHost(ModeHost):
    """Sparsification at eviction and re-evaluation after each new turn (both on the eviction thread).

    Per row (sequence): the last `reevaluate_queries` queries of its current turn and whether its
    turn awaits re-evaluation. A row's turn is re-scored at the first decode step in which the row
    decodes (has a position) and has offloaded blocks (published): what the row would see alone,
    whichever rows share its batch. A row still prefilling while others decode (the serving
    engine) is not re-scored at their decode steps (its CPU part is not attended there): re-scoring
    every offloaded token of a growing prompt at every step was O(prompt) host work per step,
    waited for, and its last chunks' queries replace what such a re-scoring chose anyway."""

    def __init__(self, context):
        self.ctx = context
        n_layers, batch = context.shape.n_layers, context.shape.batch
        # [layer][row] -> the row's turn queries [<= keep, Hq, D] float32, or None
        self.turn_queries: list[list[np.ndarray | None]] = [[None] * batch for _ in range(n_layers)]
        # (tail [B, keep, Hq, D], valid [B]) of the last prefill chunk, per layer (receive_queries)
        self.tails: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self.chunk_pending = False  # a prefill chunk ran since its queries were collected
        self.new_turn = np.zeros(batch, bool)  # rows whose turn awaits its re-evaluation
        self.stats = HgcaCounters()

    def step_start(self, cache):
        if self.chunk_pending:           # the last step was a prefill chunk: its queries reach the
            jax.block_until_ready(cache)  # host inside the step; let them land before they are read
        return cache

    def receive_queries(self, layer, tail, valid):
        self.tails[layer] = (tail, valid)

    def blocks_evicted(self, layer, numbers_by_seq):
        """(Eviction thread) keep the salient tokens of the blocks just stored: done before the
        blocks are published, so the CPU attends them from the first step it owns them."""
        cfg = self.ctx.config
        sparsify_evicted(self.ctx.store, layer, list(numbers_by_seq), list(numbers_by_seq.values()),
                         cfg.beta, cfg.window_tokens, cfg.keep_after, cfg.max_keep_share)

    def before_prefill_chunk(self, positions):
        self._collect_turn_queries()
        self.chunk_pending = True
        self.new_turn |= (positions >= 0).any(axis=1)

    def before_decode(self, cache, offloaded_before):
        if self.new_turn.any():
            self._reevaluate()
        return cache

    def reset_rows(self, rows):
        """The rows' turn queries and pending re-evaluation are dropped (the last chunk's queries
        are collected first, so the other rows keep theirs); their kept tokens go with the store's
        sequences (the runtime frees them)."""
        self._collect_turn_queries()
        for layer_queries in self.turn_queries:
            for b in rows.tolist():
                layer_queries[b] = None
        self.new_turn[rows] = False

    def exchange_pages(self, published):
        return ContextPages.of(self.ctx.store, self.ctx.shape.n_layers, self.ctx.shape.batch,
                               published * self.ctx.config.block_size)

    def adopted(self, store_replaced):
        """A filled store: its kept tokens = the salient ones of every adopted block by the MAW it
        holds (what sparsification at eviction would have kept); a restored history re-scores
        instead (`restored`)."""
        self.new_turn[:] = False
        if not store_replaced:
            return
        cfg, store = self.ctx.config, self.ctx.store
        published = self.ctx.published()
        with store.lock:
            for layer in range(self.ctx.shape.n_layers):
                for b in range(self.ctx.shape.batch):
                    for h in range(self.ctx.shape.hkv):
                        store.context.clear_head_locked(layer, b, h)
        for layer in range(self.ctx.shape.n_layers):
            sparsify_evicted(store, layer, range(self.ctx.shape.batch), [np.arange(e) for e in published],
                             cfg.beta, cfg.window_tokens, cfg.keep_after, cfg.max_keep_share)

    def restored(self, queries):
        """A restored history (HCache): re-score its offloaded tokens with its last queries
        {layer: [1, R, Hq, D]} (what a prefill's first decode step would have done)."""
        for layer, q in sorted(queries.items()):
            self._reevaluate_layer(layer, [0], np.asarray(q, np.float32))

    def counters(self):
        return self.stats.as_dict()

    def reset_counters(self):
        self.stats.reset()

    def row_stats(self):
        """kept_share: tokens in the context cache / offloaded tokens (over layers, sequences and KV
        heads; what the salience threshold kept)."""
        store, shape = self.ctx.store, self.ctx.shape
        kept = sum(int(store.context.kept_counts(layer, b).sum())
                   for layer in range(shape.n_layers) for b in range(shape.batch))
        stored = sum(store.n_tokens(layer, b) for layer in range(shape.n_layers) for b in range(shape.batch))
        return {"kept_share": round(kept / stored / shape.hkv, 4)} if stored else {}

    def _collect_turn_queries(self) -> None:
        """Keep the last `reevaluate_queries` queries of each row the last prefill chunk wrote."""
        if not self.chunk_pending:
            return
        keep = self.ctx.config.reevaluate_queries
        for layer in range(self.ctx.shape.n_layers):
            tail = self.tails.pop(layer, None)
            if tail is None:
                continue
            queries, valid = tail
            for b in range(self.ctx.shape.batch):
                n = min(keep, int(valid[b]))
                if n == 0:
                    continue
                mine = np.array(queries[b, keep - n:], np.float32)
                old = self.turn_queries[layer][b]
                if n < keep and old is not None:  # a short chunk: the turn's earlier queries too
                    mine = np.concatenate([old, mine])[-keep:]
                self.turn_queries[layer][b] = mine
        self.chunk_pending = False

    def _reevaluate(self) -> None:
        """Re-score the offloaded tokens of the rows whose new turn awaits it, that decode in this
        step and that have offloaded blocks (the others wait for their first such step), rows of
        equal query counts in one call per layer."""
        self._collect_turn_queries()
        due = np.flatnonzero(self.new_turn & (self.ctx.published() > 0) & self.ctx.step_rows())
        if due.size == 0:
            return
        queued = False
        for layer in range(self.ctx.shape.n_layers):
            groups: dict[int, list[int]] = {}
            for b in due.tolist():
                q = self.turn_queries[layer][b]
                if q is not None and q.shape[0]:
                    groups.setdefault(q.shape[0], []).append(b)
            for seqs in groups.values():
                self._reevaluate_layer(layer, seqs, np.stack([self.turn_queries[layer][b] for b in seqs]))
                queued = True
            for b in due.tolist():
                self.turn_queries[layer][b] = None
        self.new_turn[due] = False
        if queued:
            self.ctx.wait_background()  # the step's CPU attention reads the re-evaluated context

    def _reevaluate_layer(self, layer: int, seqs, queries: np.ndarray) -> None:
        """Queue one layer's re-evaluation on the eviction thread: serialised with the sparsification
        of newly evicted blocks, so neither sees the other half done (a token kept twice)."""
        cfg = self.ctx.config
        self.ctx.background(reevaluate, self.ctx.store, layer, list(seqs), queries, cfg.beta, self.ctx.shape.scale,
                            cfg.keep_after, cfg.max_keep_share)
        self.stats.add(n_reevaluations=1)
