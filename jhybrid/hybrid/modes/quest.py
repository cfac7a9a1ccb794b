"""`quest`: GPU-only block-sparse attention (Quest), the fair baseline of the offloading modes.

Every token's K/V stays on the device, laid out in blocks of `block_size` tokens; each decode step
attends, per (sequence, KV head), the sinks, the recent window and the `budget`'s top-k of the
other blocks by Quest's digest bound (the same selection scout makes over its offloaded blocks),
with the Pallas block-sparse kernel. No host at all: a user who only wants speed and whose KV fits
the device would pick this; an offloading mode must beat it by holding more sequences.

Layer state (`QuestState`), NB = ceil(max_len / bs) blocks per sequence:
  k, v        [B * NB, Hkv, bs, D] model dtype: block n of sequence b is row b * NB + n
  kmin, kmax  [B, Hkv, NB, D] model dtype: Quest digests, folded in token by token
  selected    [B, Hkv, k] int32: the top-k of the last decode step (-1 past the candidates)
Decode: the attended blocks are the sink blocks (ceil(sink / bs)), the blocks holding the last
`window_tokens - sink` tokens and the top-k of the blocks between them, rounded out to whole
blocks; the partial last block attends only its written tokens. Prefill / append chunks are exact:
on the GPU the flash kernel `range_attention` over the blocks as they lie (kv_layout "blocks"),
elsewhere plain jnp causal attention over a position-ordered copy. Sliding-window layers attend
their window exactly, the same way.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from jhybrid.attention.base import AttentionBackend, LayerContext, RowKV
from jhybrid.attention.full import masked_attention
from jhybrid.hybrid.modes.base import OffloadMode
from jhybrid.hybrid.rows import check_rows, reset_cache_rows
from pallas_kernels._common import resolve_backend
from pallas_kernels.block_digest import block_scores, update_digests
from pallas_kernels.block_sparse_attention import block_sparse_attention
from pallas_kernels.range_attention import causal_ranges, range_attention


@struct.dataclass
class QuestState:
    """One layer of the quest cache (see the module docstring for shapes)."""

    k: jax.Array
    v: jax.Array
    kmin: jax.Array
    kmax: jax.Array
    selected: jax.Array


class Quest(OffloadMode):
    name = "quest"
    settings = frozenset({"window_tokens", "gpu_ratio", "sink", "block_size", "budget", "kernel_backend"})
    offloads = False
    default_window_tokens = 272  # 16 sinks + the last 256 tokens, as scout's default window
    default_budget = 2048  # as scout's

    @classmethod
    def config_problems(cls, config):
        if config.budget is None:
            return [("budget", None, "quest selects a budget of tokens: expected 'auto' or a positive int")]
        return []

    def own_backend(self):
        return QuestAttention(self.config)

    def row_fields(self) -> dict:
        return {"budget": self.config.effective_budget}


class QuestAttention(AttentionBackend):
    """The `quest` backend (module docstring). `config`: an OffloadConfig of mode quest."""

    reuses_rows = True

    def __init__(self, config):
        if config.window_tokens is None:
            raise ValueError("quest needs a concrete window: make_backend(config, context=...) resolves gpu_ratio")
        self.config = config
        self.name = config.mode

    def __eq__(self, other):
        return type(other) is QuestAttention and other.config == self.config

    def __hash__(self):
        return hash((QuestAttention, self.config))

    def _blocks(self, max_len: int) -> int:
        return -(-max_len // self.config.block_size)

    def init_layer_cache(self, config, layer_idx, batch_size, max_len, dtype):
        cfg, nb = self.config, self._blocks(max_len)
        k = min(cfg.topk_blocks, nb)
        shape = (batch_size * nb, config.num_kv_heads, cfg.block_size, config.head_dim)
        digest = (batch_size, config.num_kv_heads, nb, config.head_dim)
        return QuestState(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                          kmin=jnp.zeros(digest, dtype), kmax=jnp.zeros(digest, dtype),
                          selected=jnp.full((batch_size, config.num_kv_heads, k), -1, jnp.int32))

    def row_kv(self) -> RowKV:
        return QuestRowKV(self.config.block_size)

    def reset_rows(self, cache, rows):
        """Empties rows `rows` for new sequences (continuous batching): lengths 0, their blocks,
        digests and selections as a fresh cache's (one jitted call, `jhybrid.hybrid.rows`). Nothing
        on the host."""
        rows = check_rows(rows, cache.lengths.shape[0])
        if rows.size == 0:
            return cache
        return reset_cache_rows(cache, rows, _empty_quest)

    def selections(self, cache):
        import numpy as np

        return [np.asarray(s.selected) for s in cache.layers if isinstance(s, QuestState)] or None

    def row_fields(self) -> dict:
        return {"budget": self.config.effective_budget}

    def attend(self, layer_idx, q, k, v, positions, lengths, layer_cache: QuestState, context: LayerContext):
        cfg = self.config
        bs = cfg.block_size
        b, t, hkv, d = k.shape
        nb = layer_cache.kmin.shape[2]
        # write the step's tokens into their blocks (padding, position -1, dropped)
        state = _store_pages(layer_cache, jnp.arange(b)[:, None] * nb, k, v, positions, bs)
        kmin, kmax = update_digests(state.kmin, state.kmax, k, positions, bs)
        state = state.replace(kmin=kmin, kmax=kmax)
        exact = t > 1 or context.sliding_window is not None  # prefill / append, or a sliding layer
        kernel = resolve_backend(cfg.kernel_backend)
        if exact and kernel != "reference":
            # over the blocks as they lie: no [B, L, Hkv, D] copy of the cache, no [B, Hq, T, L] scores
            key_lo, key_hi = causal_ranges(positions, lengths, context.sliding_window)
            o, _ = range_attention(q, state.k, state.v, key_lo, key_hi, kv_layout="blocks", scale=context.scale,
                                   backend=kernel)
            return o, state, context.carry
        if exact:
            keys = state.k.reshape(b, nb, hkv, bs, d).transpose(0, 1, 3, 2, 4).reshape(b, nb * bs, hkv, d)
            values = state.v.reshape(b, nb, hkv, bs, d).transpose(0, 1, 3, 2, 4).reshape(b, nb * bs, hkv, d)
            o, _ = masked_attention(q, keys, values, positions, lengths, context.scale, context.sliding_window)
            return o, state, context.carry
        ids, counts, lens, selected = self._attended_blocks(q, state, lengths)
        o, _ = block_sparse_attention(q, state.k, state.v, ids, counts, lens, scale=context.scale,
                                      backend=cfg.kernel_backend)
        o = jnp.where((positions >= 0)[:, :, None, None], o, 0)
        return o.astype(q.dtype), state.replace(selected=selected), context.carry

    def _attended_blocks(self, q, state: QuestState, lengths):
        """-> (pool ids [B, Hkv, M] int32 (b * NB + block, listed first), counts [B, Hkv], valid tokens
        of every pool block [B * NB], the top-k [B, Hkv, k]): sinks + recent window + top-k."""
        cfg = self.config
        bs = cfg.block_size
        b, hkv, nb, _ = state.kmin.shape
        k = state.selected.shape[2]
        n = lengths.astype(jnp.int32)
        sink_blocks = -(-cfg.sink // bs)
        recent = cfg.window_tokens - cfg.sink
        last = (n + bs - 1) // bs  # blocks holding tokens
        recent_first = jnp.maximum(jnp.maximum(n - recent, 0) // bs, sink_blocks)  # first recent block [B]
        scores = block_scores(q[:, 0].astype(state.kmin.dtype), state.kmin, state.kmax, recent_first,
                              backend=cfg.kernel_backend)  # -inf from recent_first on
        scores = jnp.where(jnp.arange(nb)[None, None, :] < sink_blocks, -jnp.inf, scores)
        top_scores, top = jax.lax.top_k(scores, k)
        selected = jnp.where(jnp.isfinite(top_scores), top, -1).astype(jnp.int32)  # [B, Hkv, k]
        n_recent = -(-recent // bs) + 1
        recent_ids = recent_first[:, None] + jnp.arange(n_recent)[None, :]  # [B, n_recent]
        recent_ids = jnp.where(recent_ids < last[:, None], recent_ids, -1)
        sinks = jnp.where(jnp.arange(sink_blocks)[None, :] < last[:, None], jnp.arange(sink_blocks)[None, :], -1)
        forced = jnp.concatenate([sinks, recent_ids], axis=1)  # [B, F]
        listed = jnp.concatenate([jnp.broadcast_to(forced[:, None, :], (b, hkv, forced.shape[1])), selected],
                                 axis=2)  # [B, Hkv, M]
        order = jnp.argsort(listed < 0, axis=-1, stable=True)  # listed blocks first
        listed = jnp.take_along_axis(listed, order, axis=-1)
        counts = jnp.sum(listed >= 0, axis=-1).astype(jnp.int32)
        ids = jnp.where(listed >= 0, jnp.arange(b, dtype=jnp.int32)[:, None, None] * nb + listed, 0)
        lens = jnp.clip(n[:, None] - jnp.arange(nb)[None, :] * bs, 0, bs).reshape(b * nb).astype(jnp.int32)
        return ids.astype(jnp.int32), counts, lens, selected


def _store_pages(state: QuestState, first_page, k, v, positions, bs: int) -> QuestState:
    """state with k, v [..., T, Hkv, D] written at positions [..., T] of the sequences whose first
    page is first_page (broadcast against positions: [B, 1] or a scalar); position -1 dropped."""
    ok = positions >= 0
    page = jnp.where(ok, first_page + positions // bs, state.k.shape[0])[..., None]  # out of range: dropped
    slot = jnp.where(ok, positions % bs, 0)[..., None]
    heads = jnp.arange(state.k.shape[1])
    return state.replace(k=state.k.at[page, heads, slot].set(k.astype(state.k.dtype), mode="drop"),
                         v=state.v.at[page, heads, slot].set(v.astype(state.v.dtype), mode="drop"))


class QuestRowKV(RowKV):
    """A row's tokens in quest's pages (the serving engine's prefix-cache copies): token p of row b
    at page b * NB + p // bs, slot p % bs; a write folds the tokens into the row's digests as the
    prefill's own writes do (`update_digests`), so a placed prefix equals a prefilled one."""

    def __init__(self, block_size: int):
        self.block_size = block_size

    def __eq__(self, other):
        return type(other) is QuestRowKV and other.block_size == self.block_size

    def __hash__(self):
        return hash((QuestRowKV, self.block_size))

    def read(self, layers, row, positions):
        bs = self.block_size
        out = []
        for state in layers:
            page = row * state.kmin.shape[2] + positions // bs
            out.append(jnp.stack([state.k[page, :, positions % bs], state.v[page, :, positions % bs]]))
        return jnp.stack(out)  # [L, 2, T, Hkv, D]

    def write(self, layers, row, kv, positions):
        bs = self.block_size
        out = []
        for i, state in enumerate(layers):
            state = _store_pages(state, row * state.kmin.shape[2], kv[i, 0], kv[i, 1], positions, bs)
            kmin, kmax = update_digests(state.kmin[row][None], state.kmax[row][None], kv[i, 0][None],
                                        positions[None], bs)
            out.append(state.replace(kmin=state.kmin.at[row].set(kmin[0]), kmax=state.kmax.at[row].set(kmax[0])))
        return tuple(out)


def _empty_quest(cache):
    """An empty quest cache of the shapes of `cache` (`reset_cache_rows`): zeros, no selection."""
    layers = tuple(QuestState(k=jnp.zeros_like(s.k), v=jnp.zeros_like(s.v), kmin=jnp.zeros_like(s.kmin),
                              kmax=jnp.zeros_like(s.kmax), selected=jnp.full_like(s.selected, -1))
                   for s in cache.layers)
    return layers, None


__all__ = ["Quest", "QuestAttention", "QuestState", "QuestRowKV"]
