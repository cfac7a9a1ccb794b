"""Prefill over the offloaded prompt on the device (`OffloadConfig.prefill_offloaded="device"`).

The attention over the uploaded copies against a float64 NumPy reference (ragged lengths, GQA, an
empty sequence); the upload against the host store; whole runs (prefill + an appended turn +
decode) on the device path against full attention and against the host path, including hgca with
a real threshold (its re-evaluation must get the same queries on both paths); the size limit's
fallback to the host path.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from host import KVStore, StoreConfig
from jhybrid.generation import make_step
from jhybrid.hybrid import OffloadConfig, make_backend
from jhybrid.hybrid.prefill import offloaded_attention, offloaded_prompt, offloaded_prompt_bytes
from jhybrid.models import create_model
from tests.hybrid_support import CHUNK, MAX_LEN, TINY as CONFIG, TOL, WINDOW, run_forced, window_only_chunks


@pytest.fixture(autouse=True, scope="module")
def full_float32_matmuls():
    """On a GPU (where the device path is the default) XLA's float32 matmuls default to TF32
    (~1e-3 relative): these tolerances are for float32 arithmetic."""
    with jax.default_matmul_precision("highest"):
        yield


def reference_attention(q, k, v, n_valid, scale):
    """float64: q [B, T, Hq, D], k/v [B, Hkv, P, D] -> o [B, T, Hq, D], lse [B, T, Hq]."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, hq, d = q.shape
    g = hq // k.shape[1]
    o = np.zeros((b, t, hq, d))
    lse = np.full((b, t, hq), -np.inf)
    for bi in range(b):
        n = int(n_valid[bi])
        if n == 0:
            continue
        for h in range(hq):
            s = q[bi, :, h] @ k[bi, h // g, :n].T * scale  # [T, n]
            m = s.max(axis=1, keepdims=True)
            p = np.exp(s - m)
            o[bi, :, h] = (p / p.sum(1, keepdims=True)) @ v[bi, h // g, :n]
            lse[bi, :, h] = np.log(p.sum(1)) + m[:, 0]
    return o, lse


@pytest.mark.parametrize("kernel", ["reference", "interpret"])  # jnp; the GPU's flash kernel (interpreted)
@pytest.mark.parametrize("hq,hkv", [(4, 2), (6, 6), (8, 1)])
def test_offloaded_attention_matches_float64(hq, hkv, kernel):
    rng = np.random.default_rng(hq * 10 + hkv)
    b, t, p, d = 3, 5, 48, 64
    q = rng.standard_normal((b, t, hq, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, p, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, p, d)).astype(np.float32)
    n_valid = np.array([48, 17, 0], np.int32)  # full, ragged, nothing offloaded yet
    for bi, n in enumerate(n_valid):  # keys past n_valid are poison (must be masked); values there
        k[bi, :, n:] = 1e4                # are zeros, as offloaded_prompt writes them
        v[bi, :, n:] = 0.0
    positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    o, lse = offloaded_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(n_valid), 0.125,
                                 positions, kernel)
    o_ref, lse_ref = reference_attention(q, k, v, n_valid, 0.125)
    np.testing.assert_allclose(np.asarray(o), o_ref, atol=2e-5, rtol=2e-5)
    np.testing.assert_allclose(np.asarray(lse)[:2], lse_ref[:2], atol=2e-5, rtol=2e-5)
    assert np.all(np.isneginf(np.asarray(lse)[2])) and not np.asarray(o)[2].any()


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8"])
def test_offloaded_prompt_copies_the_store_ragged(kv_dtype):
    cfg = StoreConfig(n_layers=2, n_kv_heads=2, head_dim=64, block_size=16, kv_dtype=kv_dtype)
    store = KVStore(cfg)
    rng = np.random.default_rng(0)
    for seq, n in ((0, 3), (1, 1), (2, 0)):
        store.add_sequence(seq)
        for layer in range(2):
            if n:
                k = rng.standard_normal((n, 16, 2, 64)).astype(np.float32)
                v = rng.standard_normal((n, 16, 2, 64)).astype(np.float32)
                store.append_blocks(layer, seq, k, v, np.zeros((n, 16, 2), np.float32),
                                    np.arange(n * 16).reshape(n, 16))
    device = jax.devices()[0]
    layers, n_valid = offloaded_prompt(store, 3, jnp.float32, device)
    assert n_valid.tolist() == [48, 16, 0]
    assert layers[0][0].shape == (3, 2, 64, 64)  # P = next power of two of 3 blocks, x 16
    assert offloaded_prompt_bytes(store, 3, 4) == 2 * 2 * 3 * 2 * 64 * 64 * 4
    for layer in range(2):
        for seq, n in ((0, 48), (1, 16)):
            blocks = store.read_blocks(layer, seq)  # k [n, bs, Hkv, W] storage (bf16 bits / int8 + scale)
            from host.store_format import from_storage
            want = from_storage(blocks["k"], kv_dtype).transpose(2, 0, 1, 3).reshape(2, n, 64)
            got = np.asarray(layers[layer][0][seq])
            np.testing.assert_array_equal(got[:, :n], want)
            assert not got[:, n:].any()
        assert not np.asarray(layers[layer][1][2]).any()


@pytest.fixture(scope="module")
def model():
    return create_model(CONFIG, seed=0)


def forced(model, backend, seed=1234):
    """Prompt 72 tokens (chunks of 16), a 20-token turn appended before decode step 10, 30 decode
    steps: prefill chunks that see offloaded blocks on both the prompt (chunks 3-5; 4 and 5 extend
    the copies with the blocks evicted before them) and the appended turn (copied from the store)."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, 97, (2, 72)).astype(np.int32)
    cont = rng.integers(0, 97, (2, 30)).astype(np.int32)
    turn = rng.integers(0, 97, (2, 20)).astype(np.int32)
    return run_forced(model, backend, prompt, cont, turns={10: turn})


@pytest.fixture(scope="module")
def full_logits(model):
    return forced(model, make_backend("full"))[0]


@pytest.mark.parametrize("mode,extra", [("hgca", dict(beta=1e-30)), ("topk", {}), ("recall", {}),
                                        ("scout", dict(predict_query=False))])
def test_device_prefill_keep_all_equals_full(model, full_logits, mode, extra):
    backend = make_backend(OffloadConfig(mode=mode, prefill_offloaded="device", **WINDOW, **extra))
    logits, backend, cache, _ = forced(model, backend)
    np.testing.assert_allclose(logits, full_logits, atol=TOL, rtol=TOL)
    counters = backend.counters()
    assert counters["n_prefill_device_chunks"] >= 2 and counters["n_prefill_host_chunks"] == 0
    assert counters["n_prefill_extends"] >= 1  # a chunk after another extended its copies on the device
    copy = cache.layers[0].offloaded  # the prefill copies were dropped after the prefill ...
    if mode == "recall":  # ... recall's decode steps upload the whole offloaded KV instead
        assert copy.k.shape[2] == backend.runtime.nb_max * 16
        np.testing.assert_array_equal(np.asarray(copy.n_valid), backend.runtime.offloaded_blocks() * 16)
    else:
        assert copy is None


def test_device_prefill_through_the_flash_kernel_equals_full(model, full_logits):
    """The GPU's path (`range_attention` over the copies), run by the Pallas interpreter."""
    backend = make_backend(OffloadConfig(mode="hgca", beta=1e-30, prefill_offloaded="device",
                                         kernel_backend="interpret", **WINDOW))
    logits, backend, _, _ = forced(model, backend)
    np.testing.assert_allclose(logits, full_logits, atol=TOL, rtol=TOL)
    assert backend.counters()["n_prefill_device_chunks"] >= 2


def test_device_and_host_prefill_agree_for_hgca_with_a_threshold(model):
    """beta = 1 drops tokens: the two paths agree only if the re-evaluation gets the same queries."""
    runs = {}
    for where in ("host", "device"):
        backend = make_backend(OffloadConfig(mode="hgca", beta=1.0, prefill_offloaded=where, **WINDOW))
        logits, backend, _, _ = forced(model, backend)
        runs[where] = (logits, backend.counters())
    np.testing.assert_allclose(runs["device"][0], runs["host"][0], atol=1e-5, rtol=1e-5)
    assert runs["device"][1]["n_reevaluations"] == runs["host"][1]["n_reevaluations"] > 0
    assert runs["device"][1]["n_prefill_device_chunks"] > 0 == runs["host"][1]["n_prefill_device_chunks"]


@pytest.mark.parametrize("host_kv_dtype", ["int8", "bf16"])
@pytest.mark.parametrize("mode,extra", [("hgca", dict(beta=1e-30)), ("topk", dict(budget=16))])
def test_rounding_store_device_and_host_prefill_agree(model, mode, extra, host_kv_dtype):
    """With a store that rounds (int8, or bf16 under this float32 model) both paths must attend the
    stored rows: the device path may not extend its copies with the evicted blocks' unrounded
    values (int8: differences of 1e-2 from the first decode step; bf16: 1.4e-3). The two paths'
    float32 rounding differs (~1e-7 in K), and a value on a rounding boundary then moves a whole
    rounding step: the bounds are per format, between the fixed and the broken behaviour."""
    runs = {}
    for where in ("host", "device"):
        backend = make_backend(OffloadConfig(**{**WINDOW, "mode": mode, "prefill_offloaded": where,
                                                "host_kv_dtype": host_kv_dtype, **extra}))
        logits, backend, _, _ = forced(model, backend)
        runs[where] = (logits, backend.counters())
    # Measured: int8 fixed <= 2e-6 / 3e-4, unfixed 1e-2; bf16 fixed <= 2e-5 / 1.1e-4, unfixed 1.4e-3 / 1.8e-3.
    first, every = {"int8": (1e-5, 1e-3), "bf16": (1e-4, 5e-4)}[host_kv_dtype]
    np.testing.assert_allclose(runs["device"][0][:, :2], runs["host"][0][:, :2], atol=first, rtol=0)
    np.testing.assert_allclose(runs["device"][0], runs["host"][0], atol=every, rtol=0)
    assert runs["device"][1]["n_prefill_device_chunks"] >= 2
    assert runs["device"][1]["n_prefill_extends"] == 0


def run_ragged(model, backend, lengths=(70, 37), steps=6, chunk=16, seed=7):
    """Ragged prompts (padding positions -1) in chunks, then `steps` decode steps per row at its own
    position: a sequence whose prompt ended keeps being padded while the other's chunks continue.
    Returns decode logits [B, steps, V]."""
    step, params = make_step(model, backend)
    rng = np.random.default_rng(seed)
    batch, longest = len(lengths), max(lengths)
    prompt = rng.integers(0, 97, (batch, longest)).astype(np.int32)
    cont = rng.integers(0, 97, (batch, steps)).astype(np.int32)
    backend.open(model.config, batch, MAX_LEN)
    cache = model.init_cache(batch, MAX_LEN, backend)
    for s in range(0, longest, chunk):
        pos = s + np.arange(chunk)[None].repeat(batch, 0)
        pos = np.where(pos < np.array(lengths)[:, None], pos, -1).astype(np.int32)
        part = np.pad(prompt[:, s:s + chunk], ((0, 0), (0, chunk - prompt[:, s:s + chunk].shape[1])))
        cache = backend.before_step(cache, pos)
        _, cache = step(params, part, pos, cache)
    out = []
    for i in range(steps):
        pos = (np.array(lengths) + i)[:, None].astype(np.int32)
        cache = backend.before_step(cache, pos)
        logits, cache = step(params, cont[:, i:i + 1], pos, cache)
        out.append(np.asarray(logits[:, 0]))
    return np.stack(out, 1), backend


def test_device_prefill_ragged_lengths_equal_full_and_host(model):
    """Ragged prompts: the shorter one stops evicting while the longer one's copies keep growing."""
    full, _ = run_ragged(model, make_backend("full"))
    keep_all, backend = run_ragged(model, make_backend(OffloadConfig(mode="hgca", beta=1e-30,
                                                                    prefill_offloaded="device", **WINDOW)))
    np.testing.assert_allclose(keep_all, full, atol=TOL, rtol=TOL)
    assert backend.counters()["n_prefill_extends"] >= 1
    runs = {where: run_ragged(model, make_backend(OffloadConfig(
        **{**WINDOW, "mode": "topk", "budget": 16, "prefill_offloaded": where})))[0] for where in ("host", "device")}
    np.testing.assert_allclose(runs["device"], runs["host"], atol=1e-5, rtol=1e-5)


def test_upload_over_the_limit_uses_the_host_path_and_says_so(model, full_logits, caplog):
    backend = make_backend(OffloadConfig(mode="hgca", beta=1e-30, prefill_offloaded="device",
                                        prefill_upload_max_bytes=1, **WINDOW))
    with caplog.at_level(logging.WARNING, logger="jhybrid.hybrid.prefill"):
        logits, backend, _, _ = forced(model, backend)
    np.testing.assert_allclose(logits, full_logits, atol=TOL, rtol=TOL)
    counters = backend.counters()
    assert counters["n_prefill_device_chunks"] == 0 and counters["n_prefill_host_chunks"] >= 2
    assert "exceeds prefill_upload_max_bytes=1" in caplog.text


def test_auto_is_device_on_a_gpu_host_elsewhere_and_bad_values_are_named(model):
    backend = make_backend(OffloadConfig(mode="hgca", beta=1e-30, **WINDOW))  # "auto"
    _, backend, _, _ = forced(model, backend)
    on_gpu = jax.devices()[0].platform == "gpu"
    assert (backend.counters()["n_prefill_device_chunks"] > 0) == on_gpu
    with pytest.raises(ValueError, match="prefill_offloaded='gpu'"):
        OffloadConfig(prefill_offloaded="gpu")
    with pytest.raises(ValueError, match="prefill_upload_max_bytes=-1"):
        OffloadConfig(prefill_upload_max_bytes=-1)


def run_interleaved(model, backend, chunk=16, steps=4, seed=11, gap=1):
    """The serving engine's pattern on two rows: row 1's 56-token prompt in chunks, then row 0's
    72-token prompt in chunks with `gap` decode steps of row 1 after each (row 0 padded), then row 0
    is reset and a 60-token prompt prefilled the same way, then `steps` decode steps of both.
    Returns (row 1's interleaved decode logits [n, V], the final decode logits [2, steps, V], backend)."""
    step, params = make_step(model, backend)
    rng = np.random.default_rng(seed)
    first, second, other = (rng.integers(0, 97, n).astype(np.int32) for n in (72, 60, 56))
    decode = rng.integers(0, 97, (64,)).astype(np.int32)
    backend.open(model.config, 2, MAX_LEN)
    cache = model.init_cache(2, MAX_LEN, backend)
    held = np.zeros(2, np.int64)
    used = iter(range(64))

    def chunk_of(row, tokens):
        nonlocal cache
        for s in range(0, len(tokens), chunk):
            part = tokens[s:s + chunk]
            toks = np.zeros((2, chunk), np.int32)
            pos = np.full((2, chunk), -1, np.int32)
            toks[row, :len(part)] = part
            pos[row, :len(part)] = held[row] + np.arange(len(part))
            cache = backend.before_step(cache, pos)
            _, cache = step(params, toks, pos, cache)
            held[row] += len(part)
            yield

    def decode_rows(rows):
        nonlocal cache
        toks = np.zeros((2, 1), np.int32)
        pos = np.full((2, 1), -1, np.int32)
        for row in rows:
            toks[row, 0] = decode[next(used)]
            pos[row, 0] = held[row]
        cache = backend.before_step(cache, pos)
        logits, cache = step(params, toks, pos, cache)
        held[list(rows)] += 1
        return np.asarray(logits[:, 0])

    for _ in chunk_of(1, other):
        pass
    between = []
    for prompt in (first, second):
        for _ in chunk_of(0, prompt):
            for _ in range(gap):
                between.append(decode_rows([1])[1])
        if prompt is first:
            cache = backend.reset_rows(cache, np.array([0]))
            held[0] = 0
    final = [decode_rows([0, 1]) for _ in range(steps)]
    return np.stack(between), np.stack(final, 1), backend


def test_device_prefill_between_decode_steps_extends_and_uploads_each_row_once(model):
    """Prefill chunks with a decode step of the other row between them (the serving engine): the
    copies are kept across the decode step and extended, so each prompt is copied from the store
    once (when its row first has offloaded blocks), and a reset row is copied again; outputs equal
    full attention (keep-all; a dropped or stale block would change them)."""
    want = run_interleaved(model, make_backend("full"))
    got = run_interleaved(model, make_backend(OffloadConfig(mode="hgca", beta=1e-30, prefill_offloaded="device",
                                                            **WINDOW)))
    for w, g in zip(want[:2], got[:2]):
        np.testing.assert_allclose(g, w, atol=TOL, rtol=TOL)
    counters = got[2].counters()
    # row 1's prompt, row 0's first prompt and, after its reset, its second one: each row's first
    # chunk past the window evicts all its offloaded blocks, and its copies are those, taken on the
    # device; no row is copied from the host store
    assert counters["n_prefill_rows_from_evicted"] == 3 and counters["n_prefill_row_uploads"] == 0
    # 7 chunks see offloaded blocks (3 of them a row's first); 5 extend with blocks evicted before
    # them: the 2 that follow a row's first, and the 3 first (their copies begin as those blocks)
    assert counters["n_prefill_device_chunks"] == 7 and counters["n_prefill_extends"] == 5
    assert counters["n_prefill_host_chunks"] == 0
    # the other 6 chunks (each prompt's first two: <= window_tokens=40 tokens) attend to the window alone
    assert counters["n_prefill_window_chunks"] == 6


def test_copies_dropped_between_chunks_are_copied_again_from_the_store(model):
    """Two decode steps between a prompt's chunks (more than DECODE_GAP): the kept copies are
    dropped after each chunk, so every later chunk of the prompt copies its row's blocks from the host
    store again (its own blocks, padded to a power of two, into copies padded to P: the rest masked);
    each prompt's first chunk past the window takes its blocks from the evicted ones. Outputs equal
    full attention (keep-all): a block missing or a stale one unmasked would change them."""
    want = run_interleaved(model, make_backend("full"), gap=2)
    got = run_interleaved(model, make_backend(OffloadConfig(mode="hgca", beta=1e-30, prefill_offloaded="device",
                                                            **WINDOW)), gap=2)
    for w, g in zip(want[:2], got[:2]):
        np.testing.assert_allclose(g, w, atol=TOL, rtol=TOL)
    counters = got[2].counters()
    assert counters["n_prefill_rows_from_evicted"] == 3
    # 7 chunks see offloaded blocks: row 1's 2 (no decode step between them: the first's copies are
    # its evicted blocks, the second evicts none and keeps them) and row 0's two prompts' 5 (each
    # prompt's first from its evicted blocks; the 3 others copied from the store, their copies dropped
    # before them); the 3 firsts are the chunks that extend (their copies begin as those blocks)
    assert counters["n_prefill_device_chunks"] == 7 and counters["n_prefill_row_uploads"] == 3
    assert counters["n_prefill_extends"] == 3 and counters["n_prefill_host_chunks"] == 0


@pytest.mark.parametrize("where", ["host", "device"])
def test_chunks_inside_the_window_make_no_host_call(model, full_logits, where):
    """A chunk whose rows hold at most window_tokens tokens once it has run has nothing offloaded: it
    attends to the window alone (`NothingOffloaded`), with no host call, on either path; the chunks
    after it attend to their offloaded part as before (outputs equal full attention)."""
    backend = make_backend(OffloadConfig(mode="topk", prefill_offloaded=where, **WINDOW))
    logits, backend, _, _ = forced(model, backend)
    np.testing.assert_allclose(logits, full_logits, atol=TOL, rtol=TOL)
    assert backend.counters()["n_prefill_window_chunks"] == window_only_chunks([72, 72]) == 2

    backend = make_backend(OffloadConfig(mode="topk", prefill_offloaded=where, **WINDOW))
    step, params = make_step(model, backend)
    backend.open(model.config, 2, MAX_LEN)
    cache = model.init_cache(2, MAX_LEN, backend)
    prompt = np.random.default_rng(3).integers(0, 97, (2, 48)).astype(np.int32)
    for start in range(0, 40, CHUNK):  # 40 tokens, exactly the window: nothing is offloaded
        pos = start + np.arange(CHUNK, dtype=np.int32)[None].repeat(2, 0)
        pos = np.where(pos < 40, pos, -1).astype(np.int32)
        cache = backend.before_step(cache, pos)
        _, cache = step(params, prompt[:, start:start + CHUNK], pos, cache)
    counters = backend.counters()
    assert counters["n_prefill_window_chunks"] == window_only_chunks([40, 40]) == 3
    assert counters["n_tasks"] == counters["n_callbacks"] == 0  # the host was never asked
    assert counters["n_prefill_device_chunks"] == 0
    assert type(cache.layers[0].offloaded).__name__ == "NothingOffloaded"  # passed through the step ...
    cache = backend.before_step(cache, np.full((2, 1), 40, np.int32))
    assert cache.layers[0].offloaded is None  # ... and dropped at the next step start
    backend.close()  # the decode step armed above never runs: its exchange worker abandons it now


def run_paused_prompt(model, backend, chunk=16, seed=5):
    """The serving engine's pattern under a decoding step budget of one chunk, shortest prompt
    first: row 2's short prompt, then row 0's 72-token prompt (3 chunks, past the window), paused
    while row 1's 32-token prompt is prefilled inside the window (2 chunks), then resumed; a decode
    step of row 2 after each chunk, then 3 decode steps of every row.
    Returns (row 2's decode logits between the chunks [n, V], the final decode logits [3, 3, V], backend)."""
    step, params = make_step(model, backend)
    rng = np.random.default_rng(seed)
    long, short, decoding = (rng.integers(0, 97, n).astype(np.int32) for n in (72, 32, 24))
    decode = rng.integers(0, 97, (64,)).astype(np.int32)
    backend.open(model.config, 3, MAX_LEN)
    cache = model.init_cache(3, MAX_LEN, backend)
    held = np.zeros(3, np.int64)
    used = iter(range(64))

    def call(rows, tokens, width):
        nonlocal cache
        toks = np.zeros((3, width), np.int32)
        pos = np.full((3, width), -1, np.int32)
        for row, part in zip(rows, tokens):
            toks[row, :len(part)] = part
            pos[row, :len(part)] = held[row] + np.arange(len(part))
            held[row] += len(part)
        cache = backend.before_step(cache, pos)
        logits, cache = step(params, toks, pos, cache)
        return np.asarray(logits[:, -1])

    def decode_rows(rows):
        return call(rows, [decode[next(used)][None] for _ in rows], 1)

    for s in range(0, len(decoding), chunk):
        call([2], [decoding[s:s + chunk]], chunk)
    between = []
    for row, prompt, parts in ((0, long, range(0, 48, chunk)), (1, short, range(0, 32, chunk)),
                               (0, long, range(48, 72, chunk))):
        for s in parts:
            call([row], [prompt[s:s + chunk]], chunk)
            between.append(decode_rows([2])[2])
    final = [decode_rows([0, 1, 2]) for _ in range(3)]
    return np.stack(between), np.stack(final, 1), backend


def test_a_prompt_paused_by_window_only_chunks_keeps_its_copies(model):
    """Chunks of another prompt inside the window (no copies) are prefill steps too: the paused
    prompt's copies survive the decode steps between them (DECODE_GAP counts decode steps without
    a prefill step between), so it resumes without copying its blocks from the host store (on the
    H100 such a copy took 0.7-1.5 s for a 16K prompt). Outputs equal full attention (keep-all)."""
    want = run_paused_prompt(model, make_backend("full"))
    got = run_paused_prompt(model, make_backend(OffloadConfig(mode="hgca", beta=1e-30, prefill_offloaded="device",
                                                              **WINDOW)))
    for w, g in zip(want[:2], got[:2]):
        np.testing.assert_allclose(g, w, atol=TOL, rtol=TOL)
    counters = got[2].counters()
    assert counters["n_prefill_window_chunks"] >= 4  # row 2's, row 1's (and row 0's first two)
    assert counters["n_prefill_rows_from_evicted"] == 1 and counters["n_prefill_row_uploads"] == 0


@pytest.mark.parametrize("max_len", [128, 152, 200, 264])
def test_copy_sizes_cover_every_reachable_chunk_and_no_more(max_len):
    """`PrefillCopies.sizes` against an oracle that walks every length a chunk can bring a row to
    (1 .. max_len): the P `_tokens` gives each length's offloaded blocks is one of the sizes, and
    every size is given by some length (the serving engine compiles a step shape per size: an
    unreachable one is minutes of tracing on a 32-layer model). max_len 152 = 9 blocks past the
    8 sinks: nb_max 9 is out of reach (the ring keeps 32 tokens), the sizes stop at 8 blocks."""
    from jhybrid.hybrid.window import evicted_blocks

    backend = make_backend("hgca", **WINDOW, prefill_offloaded="device")
    backend.open(CONFIG, 2, max_len)
    try:
        copies, cfg = backend.runtime.prefill, backend.config
        reached = {copies._tokens(np.array([int(evicted_blocks(np.int64(n), cfg)), 0]))
                   for n in range(1, max_len + 1)}
        assert sorted(reached) == copies.sizes()
        if max_len == 152:
            assert backend.runtime.nb_max == 9 and copies.sizes() == [32, 64, 128]
    finally:
        backend.close()
