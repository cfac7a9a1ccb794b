"""8-bit host KV (host_kv_dtype="int8") end to end: keep-all exactness of every offloading mode
against `full` computed on the same dequantized KV.

The reference is full attention in which, at every step, the tokens the hybrid run held on the
host during that step (positions sink .. sink + offloaded_blocks * block_size - 1, read from the
hybrid run's StepMeta) are replaced by the dequantized rows the host store holds for them (read
back after the run, placed by their stored positions; stored blocks never change). Requantizing
the reference's own K would not do: K agrees to float32 rounding only, and a value on a rounding
boundary of the int8 grid then moves a whole step. So the only difference left is the order of
float32 arithmetic. Controls: the plain `full` logits differ from the int8 run by far more than
the tolerance, and the stored rows are the int8 round trip of the reference's K to within a step.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.attention.full import FullAttention, masked_attention, store_kv
from jhybrid.hybrid import make_backend
from jhybrid.models import create_model
from host.store_format import from_storage
from tests.hybrid_support import KEEP_ALL, MAX_LEN, SCOUT_RECALLS, TINY as CONFIG, TOL, run_forced

B, PROMPT, STEPS = 2, 40, 40


def int8_round_trip(x: jnp.ndarray) -> jnp.ndarray:
    """[..., D] -> the values an int8 host row gives back (host.store_format.quantize_int8)."""
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / jnp.float32(127.0)
    safe = jnp.where(scale > 0, scale, jnp.float32(1.0))
    return jnp.clip(jnp.round(x / safe), -127, 127) * scale


class DequantizedFull(FullAttention):
    """`full`, but each step attends the host-held positions' K/V through an int8 round trip.
    `offloaded` lists the hybrid run's offloaded_blocks [B] per step, in step order."""

    def __init__(self, offloaded: list[np.ndarray], sink: int, block_size: int, stored_k, stored_v):
        self.offloaded, self.sink, self.block_size = list(offloaded), sink, block_size
        self.stored_k, self.stored_v = stored_k, stored_v  # per layer [B, L, Hkv, D] float32

    def __eq__(self, other):
        return other is self

    def __hash__(self):
        return id(self)

    def before_step(self, cache, positions):
        return cache.replace(meta=jnp.asarray(self.offloaded.pop(0), jnp.int32))

    def attend(self, layer_idx, q, k, v, positions, lengths, layer_cache, context):
        k_cache = store_kv(layer_cache["k"], k, positions)
        v_cache = store_kv(layer_cache["v"], v, positions)
        pos = jnp.arange(k_cache.shape[1])[None, :]
        hi = self.sink + context.meta[:, None] * self.block_size
        held = ((pos >= self.sink) & (pos < hi))[:, :, None, None]  # [B, L, 1, 1]
        k_att = jnp.where(held, self.stored_k[layer_idx].astype(k_cache.dtype), k_cache)
        v_att = jnp.where(held, self.stored_v[layer_idx].astype(v_cache.dtype), v_cache)
        out, _ = masked_attention(q, k_att, v_att, positions, lengths, context.scale, context.sliding_window)
        return out, {"k": k_cache, "v": v_cache}, None


def stored_rows(store, batch: int, max_len: int):
    """The host store's dequantized K and V placed at their positions: per layer [B, L, Hkv, D]."""
    c = store.config
    ks, vs = [], []
    for layer in range(c.n_layers):
        k = np.zeros((batch, max_len, c.n_kv_heads, c.head_dim), np.float32)
        v = np.zeros_like(k)
        for b in range(batch):
            got = store.read_blocks(layer, b)
            pos = got["positions"].reshape(-1)
            k[b, pos] = from_storage(got["k"], c.kv_dtype).reshape(-1, c.n_kv_heads, c.head_dim)
            v[b, pos] = from_storage(got["v"], c.kv_dtype).reshape(-1, c.n_kv_heads, c.head_dim)
        ks.append(jnp.asarray(k))
        vs.append(jnp.asarray(v))
    return ks, vs


def recording(backend):
    """Wrap backend.before_step to record each step's offloaded_blocks."""
    seen = []
    inner = backend.before_step

    def before_step(cache, positions):
        cache = inner(cache, positions)
        seen.append(np.asarray(cache.meta.offloaded_blocks))
        return cache

    backend.before_step = before_step
    return backend, seen


@pytest.fixture(autouse=True, scope="module")
def full_float32_matmuls():
    """On a GPU XLA's float32 matmuls default to TF32 (~1e-3 relative): TOL is for float32."""
    import jax

    with jax.default_matmul_precision("highest"):
        yield


@pytest.fixture(scope="module")
def model():
    return create_model(CONFIG, seed=0)


@pytest.fixture(scope="module")
def tokens():
    rng = np.random.default_rng(4321)
    return rng.integers(0, 97, (B, PROMPT)).astype(np.int32), rng.integers(0, 97, (B, STEPS)).astype(np.int32)


CASES = {
    "recall": dict(mode="recall"),
    "hgca": dict(mode="hgca"),
    "topk": dict(mode="topk"),
    "scout-exact-query": dict(mode="scout", predict_query=False, **SCOUT_RECALLS),
}


@pytest.mark.parametrize("case", CASES)
def test_int8_keep_all_equals_full_on_dequantized_kv(model, tokens, case):
    options = {**KEEP_ALL, **CASES[case], "host_kv_dtype": "int8"}
    backend, seen = recording(make_backend(options.pop("mode"), **options))
    logits, backend, _, _ = run_forced(model, backend, *tokens)
    assert backend.runtime.store.config.kv_dtype == "int8"
    assert max(int(s.max()) for s in seen) >= 2, "the run must offload blocks for the check to mean anything"
    stored_k, stored_v = stored_rows(backend.runtime.store, B, MAX_LEN)
    reference_backend = DequantizedFull(seen, backend.config.sink, backend.config.block_size, stored_k, stored_v)
    reference, _, ref_cache, _ = run_forced(model, reference_backend, *tokens)
    np.testing.assert_allclose(logits, reference, atol=TOL, rtol=0)
    # the stored rows are the int8 round trip of the K the model computes (to within one step)
    held = slice(backend.config.sink, backend.config.sink + int(seen[-1].min()) * backend.config.block_size)
    for layer in range(CONFIG.num_layers):
        k_model = ref_cache.layers[layer]["k"][:, held]
        step = jnp.max(jnp.abs(k_model), axis=-1, keepdims=True) / 127
        assert bool((jnp.abs(stored_k[layer][:, held] - int8_round_trip(k_model)) <= step * 1.001).all())
    plain = run_forced(model, make_backend("full"), *tokens)[0]
    assert np.abs(plain - logits).max() > 10 * TOL  # control: int8 is visible at this tolerance


def test_host_kv_dtype_is_validated():
    with pytest.raises(ValueError, match="host_kv_dtype='fp8'"):
        make_backend("hgca", host_kv_dtype="fp8")
