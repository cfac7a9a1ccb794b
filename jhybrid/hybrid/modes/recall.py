"""`recall`: every offloaded token is copied back to the device before every decode step (the
FlexGen / Hugging Face OffloadedCache baseline). Exact; pays the whole offloaded KV in transfers.

Host side: a mirror of the offloaded KV in the model dtype, laid out as the device copy wants it
(`mirror_k`, `mirror_v` [L, B, Hkv, NB * bs, D]), written when blocks reach the store and uploaded
as each layer's `DeviceCopy` before each decode step. Device side: the window kernel over the GPU
window plus the same kernel over the copy's first `offloaded * bs` tokens.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from host.store_format import from_storage

from jhybrid.hybrid.modes.base import DecodeStep, HostLayout, ModeHost, OffloadMode, Workload
from jhybrid.hybrid.state import DeviceCopy, LayerState
from jhybrid.hybrid.transfer import to_device
from jhybrid.hybrid.window import decode_attention
from pallas_kernels.window_attention import window_attention


class Recall(OffloadMode):
    name = "recall"
    rebuilt_each_step = ("offloaded",)

    def layer_state(self, layer, num_layers, batch, num_kv_heads, head_dim, max_len, dtype):
        """The device copy's buffers exist from the start: device memory is what every decode step
        holds (the step start uploads into new ones, the old ones go with the donated cache)."""
        shape = (batch, num_kv_heads, self.config.host_blocks(max_len) * self.config.block_size, head_dim)
        return {"offloaded": DeviceCopy(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype),
                                        jnp.zeros((batch,), jnp.int32))}

    def decode(self, step: DecodeStep, state: LayerState):
        cfg, copy = self.config, state.offloaded
        if copy is None:
            raise RuntimeError("recall: no device copy of the offloaded KV (before_step uploads it)")
        o_w, lse_w, probs = decode_attention(cfg, step.q, state.window, step.lengths, step.offloaded, step.scale)
        o_o, lse_o = window_attention(step.q, copy.k, copy.v, copy.n_valid, 0 * copy.n_valid, scale=step.scale,
                                      backend=cfg.kernel_backend)
        return [(o_w, lse_w), (o_o, lse_o)], probs, state, None

    def host(self, context) -> "RecallHost":
        return RecallHost(context)

    def host_bytes_per_sequence(self, layout: HostLayout, offloaded_blocks, max_len, workload: Workload):
        """The store's blocks, plus the mirror: every layer's offloaded KV of max_len in the model dtype."""
        mirror = jax.eval_shape(lambda: self.layer_state(0, 1, 1, layout.n_kv_heads, layout.head_dim, max_len,
                                                         jnp.dtype(layout.dtype)))["offloaded"]
        return super().host_bytes_per_sequence(layout, offloaded_blocks, max_len, workload) + \
            layout.n_layers * (mirror.k.size + mirror.v.size) * mirror.k.dtype.itemsize


class RecallHost(ModeHost):
    def __init__(self, context):
        self.ctx = context
        shape = context.shape
        mirror = (shape.n_layers, shape.batch, shape.hkv, shape.nb_max * context.config.block_size, shape.head_dim)
        self.mirror_k = np.zeros(mirror, shape.dtype)  # zero pages are only touched when written
        self.mirror_v = np.zeros(mirror, shape.dtype)

    def blocks_stored(self, layer, seq, numbers, k, v):
        bs = self.ctx.config.block_size
        if self.ctx.store_rounds:  # the mirror holds what the host store holds: its rows' values
            kv_dtype = self.ctx.store.config.kv_dtype
            k, v = from_storage(k, kv_dtype), from_storage(v, kv_dtype)
        for j, block in enumerate(numbers):
            lo = int(block) * bs
            self.mirror_k[layer, seq, :, lo:lo + bs] = np.asarray(k[j]).transpose(1, 0, 2).astype(self.mirror_k.dtype)
            self.mirror_v[layer, seq, :, lo:lo + bs] = np.asarray(v[j]).transpose(1, 0, 2).astype(self.mirror_v.dtype)

    def before_decode(self, cache, offloaded_before):
        ctx = self.ctx
        start = time.perf_counter()
        device = next(iter(cache.layers[0].window.k_ring.devices()))
        n_valid = np.asarray(ctx.published() * ctx.config.block_size, np.int32)
        # one n_valid per layer: the step donates the cache, and a buffer cannot be donated twice
        layers = tuple(state.replace(offloaded=DeviceCopy(to_device(self.mirror_k[layer], device),
                                                          to_device(self.mirror_v[layer], device),
                                                          to_device(n_valid, device)))
                       for layer, state in enumerate(cache.layers))
        ctx.counters.add(transfer_s=time.perf_counter() - start,
                         bytes_to_device=self.mirror_k.nbytes + self.mirror_v.nbytes)
        return cache.replace(layers=layers)

    def adopted(self, store_replaced):
        """A filled store: the mirror = its blocks (a restored history's appends filled it already)."""
        if not store_replaced:
            return
        ctx, bs = self.ctx, self.ctx.config.block_size
        store, kv_dtype = ctx.store, ctx.store.config.kv_dtype
        for layer in range(ctx.shape.n_layers):
            arrays = store.layers[layer].arrays
            for b, e in enumerate(ctx.published()):
                slots = store.block_slots(layer, b)[:e]
                for name, mirror in (("k", self.mirror_k), ("v", self.mirror_v)):
                    rows = from_storage(arrays[name][slots], kv_dtype)  # [e, Hkv, bs, D]
                    mirror[layer, b, :, :e * bs] = rows.transpose(1, 0, 2, 3).reshape(ctx.shape.hkv, e * bs, -1)

    def host_bytes(self) -> int:
        return self.mirror_k.nbytes + self.mirror_v.nbytes

    def close(self):
        self.mirror_k = self.mirror_v = None
