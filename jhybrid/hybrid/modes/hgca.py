"""`hgca` (HGCA): dense GPU attention over the window (+ sinks); CPU attention over the offloaded
tokens whose moving-average attention weight (MAW) passed beta / window_tokens when their block was
evicted (`host.sparsify`), with the exact query; the two partial states merged exactly.

Device side, per layer of a decode step:
    "split":  ticket = submit(q) -> window kernel (+ its probabilities for the MAW) -> collect -> merge
              (the CPU works while the GPU attends to the window)
    "sync":   the CPU part computed inside one exchange, then the window kernel
Host side: after every eviction, sparsify the evicted blocks of each layer (eviction thread);
before the first decode step of a turn, re-score every offloaded token with the turn's last
`reevaluate_queries` queries (`host.sparsify.reevaluate`): what HGCA does after each new user turn.
The turn's queries come from the host attention calls of its prefill chunks, or, when a chunk
attended to the offloaded prompt on the device, from `prefill_token` (a tail of the chunk's queries
handed to the host inside the step).
"""

from __future__ import annotations

import jax
import numpy as np

from host.sparsify import reevaluate, sparsify_evicted
from jhybrid.hybrid.exchange import after
from jhybrid.hybrid.modes.base import DecodeStep, ModeHost, OffloadMode
from jhybrid.hybrid.state import LayerState
from jhybrid.hybrid.window import decode_attention


class Hgca(OffloadMode):
    name = "hgca"
    settings = frozenset({"alpha", "beta", "keep_after", "max_keep_share", "reevaluate_queries", "exchange"})
    decode_kind = "context"

    def decode_host_kind(self):
        return None if self.config.exchange == "sync" else "context"  # "sync": one callback per layer

    def decode(self, step: DecodeStep, state: LayerState):
        cfg, exchange = self.config, step.exchange
        if cfg.exchange == "sync":
            cpu = exchange.attend_now(step.layer, "context", step.q)
            q = after(step.q, cpu[1])
            o_w, lse_w, probs = decode_attention(cfg, q, state.window, step.lengths, step.offloaded, step.scale)
            return [(o_w, lse_w), cpu], probs, state, None
        ticket = exchange.submit(step.layer, "context", step.q)
        q = after(step.q, ticket)
        o_w, lse_w, probs = decode_attention(cfg, q, state.window, step.lengths, step.offloaded, step.scale)
        return [(o_w, lse_w), exchange.collect(step.layer, ticket, q.shape, lse_w)], probs, state, None

    def prefill_token(self, layer, q, positions, exchange):
        return exchange.record_tail(layer, q, positions, self.config.reevaluate_queries)

    def host(self, runtime) -> "HgcaHost":
        return HgcaHost(runtime)


class HgcaHost(ModeHost):
    """Sparsification at eviction and re-evaluation after each new turn (both on the host worker)."""

    def __init__(self, runtime):
        self.runtime = runtime
        self.turn_queries: list[np.ndarray | None] = [None] * runtime.n_layers  # [B, <= keep, Hq, D]
        self.last_chunk_valid: np.ndarray | None = None  # [B] valid tokens of the last prefill chunk
        self.needs_reevaluate = False
        runtime.declare_counters("n_reevaluations")

    def step_start(self, cache):
        if self.last_chunk_valid is not None:  # the last step was a prefill chunk: its queries reach the
            jax.block_until_ready(cache)       # host inside the step (host attention calls or query tails);
        return cache                           # let them land before the turn's queries are read

    def blocks_evicted(self, layer, numbers_by_seq):
        """(Eviction thread) keep the salient tokens of the blocks just stored: done before the
        blocks are published, so the CPU attends them from the first step it owns them."""
        cfg = self.runtime.config
        sparsify_evicted(self.runtime.store, layer, list(numbers_by_seq), list(numbers_by_seq.values()),
                         cfg.beta, cfg.window_tokens, cfg.keep_after, cfg.max_keep_share)

    def before_prefill_chunk(self, positions):
        self._collect_turn_queries()
        self.last_chunk_valid = (positions >= 0).sum(axis=1)
        self.needs_reevaluate = True

    def before_decode(self, cache, offloaded_before):
        if self.needs_reevaluate:
            self._reevaluate()
        return cache

    def adopted(self):
        self.needs_reevaluate = False

    def _collect_turn_queries(self) -> None:
        """Keep the last `reevaluate_queries` queries of each row seen by the last prefill chunk."""
        valid = self.last_chunk_valid
        if valid is None:
            return
        bridge, keep = self.runtime.bridge, self.runtime.config.reevaluate_queries
        for layer in range(self.runtime.n_layers):
            q = bridge.last_queries.get(layer)
            tail = bridge.turn_tails.pop(layer, None)  # the chunk ran on the device path
            if tail is None and (q is None or q.shape[1] == 1):
                continue
            old = self.turn_queries[layer]
            rows = []
            for b in range(self.runtime.batch):
                if tail is not None:
                    mine = tail[0][b, keep - min(keep, int(tail[1][b])):]
                else:
                    mine = q[b, max(0, int(valid[b]) - keep):int(valid[b])]
                if old is not None:
                    mine = np.concatenate([old[b], mine])[-keep:] if mine.shape[0] < keep else mine
                rows.append(mine)
            tq = min(r.shape[0] for r in rows)
            if tq > 0:
                self.turn_queries[layer] = np.stack([r[-tq:] for r in rows])
        self.last_chunk_valid = None

    def _reevaluate(self) -> None:
        runtime = self.runtime
        self._collect_turn_queries()
        if not runtime.offloaded_blocks().any():
            return  # nothing on the host yet: re-score at the first decode step that publishes blocks
        self.needs_reevaluate = False
        cfg = runtime.config
        for layer in range(runtime.n_layers):
            q = self.turn_queries[layer]
            if q is not None:
                self._reevaluate_layer(layer, range(runtime.batch), q)
        self.turn_queries = [None] * runtime.n_layers
        runtime.evictor.wait_background()  # the step's CPU attention reads the re-evaluated context

    def reevaluate_history(self, queries: dict[int, np.ndarray]) -> None:
        """A restored history (HCache): re-score its offloaded tokens with its last queries
        {layer: [1, R, Hq, D]} (what a prefill's first decode step would have done)."""
        for layer, q in sorted(queries.items()):
            self._reevaluate_layer(layer, [0], np.asarray(q, np.float32))

    def _reevaluate_layer(self, layer: int, seqs, queries: np.ndarray) -> None:
        """Queue one layer's re-evaluation on the eviction thread: serialised with the sparsification
        of newly evicted blocks, so neither sees the other half done (a token kept twice)."""
        cfg, runtime = self.runtime.config, self.runtime
        runtime.evictor.background(reevaluate, runtime.store, layer, list(seqs), queries, cfg.beta, runtime.scale,
                                   cfg.keep_after, cfg.max_keep_share)
        runtime.count("n_reevaluations")
