"""Multi-device checks of jhybrid.parallel, run by tests/test_parallel.py in a subprocess with 4
virtual CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=4 must be set before JAX
starts, so they cannot run in the pytest process). Usage: python tests/parallel_checks.py NAME SEED"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jhybrid.attention.full import masked_attention
from jhybrid.generation import make_step
from jhybrid.hybrid import make_backend
from jhybrid.models import create_model
from jhybrid.parallel import TensorParallel, ring_prefill, ring_prefill_cache, sequence_mesh, tensor_mesh
from jhybrid.parallel.mesh import SEQ
from jhybrid.parallel.ring import ring_attention
from tests.hybrid_support import GEMMA3_LIKE, KEEP_ALL, SCOUT_RECALLS, TINY, WINDOW, run_forced

TOL = 2e-4
# 4 KV heads (TP 1, 2, 4), a vocabulary that divides by 4
TP_CONFIG = TINY.replace(num_heads=8, num_kv_heads=4, head_dim=16, mlp_dim=256, vocab_size=96)
TP_HYBRID = TP_CONFIG.replace(head_dim=64)  # the hybrid kernels' head dims are 64 / 128 / 256
# Each offloading mode with its real policy (HGCA's threshold at beta 1, top-k budgets of 2 of the
# 2-4 offloaded blocks, scout's recalls), not keep-everything: the shards must decide as TP 1 does.
MODE_SETTINGS = {"recall": {}, "hgca": {}, "topk": {"budget": 32}, "scout": dict(budget=32, **SCOUT_RECALLS),
                 "streaming": {}}


def check_ring_attention(rng):
    """ring_attention over 2, 3 and 4 devices == masked attention over the whole sequence (GQA,
    front padding, a sliding window, a fully padded sequence)."""
    b, hq, hkv, d = 3, 4, 2, 16
    for n, t, window in ((2, 10, None), (3, 17, None), (4, 32, 5), (4, 7, None)):
        local = -(-t // n)
        total = local * n
        q = rng.standard_normal((b, total, hq, d)).astype(np.float32)
        k = rng.standard_normal((b, total, hkv, d)).astype(np.float32)
        v = rng.standard_normal((b, total, hkv, d)).astype(np.float32)
        pos = np.full((b, total), -1, np.int32)
        lengths = [t, t - 3, 0]
        for s, n_s in enumerate(lengths):
            pos[s, total - n_s:] = np.arange(n_s)
        mesh = sequence_mesh(n)
        fn = jax.jit(jax.shard_map(lambda q, k, v, p: ring_attention(q, k, v, p, 0.3, SEQ, n, window), mesh=mesh,
                                   in_specs=(jax.P(None, SEQ),) * 4, out_specs=jax.P(None, SEQ), check_vma=False))
        got = np.asarray(fn(q, k, v, pos))
        for s, n_s in enumerate(lengths):  # the reference over the valid tokens, position-indexed
            if n_s == 0:
                assert np.all(got[s] == 0)
                continue
            sl = slice(total - n_s, total)
            ref, _ = masked_attention(jnp.asarray(q[s:s + 1, sl]), jnp.asarray(k[s:s + 1, sl]),
                                      jnp.asarray(v[s:s + 1, sl]), jnp.asarray(pos[s:s + 1, sl]),
                                      jnp.asarray([n_s], jnp.int32), 0.3, window)
            np.testing.assert_allclose(got[s, sl], np.asarray(ref)[0], atol=1e-5, rtol=0)
            assert np.all(got[s, :total - n_s] == 0)


def _chunked_reference(model, tokens, max_len):
    """Chunked prefill through `full`: (last logits [B, V], cache)."""
    step, params = make_step(model)
    cache = model.init_cache(tokens.shape[0], max_len)
    for s in range(0, tokens.shape[1], 16):
        part = tokens[:, s:s + 16]
        pos = (s + np.arange(part.shape[1]))[None].repeat(tokens.shape[0], 0).astype(np.int32)
        logits, cache = step(params, part, pos, cache)
    return np.asarray(logits[:, -1]), cache


def check_ring_prefill(rng):
    """Ring prefill over 2 / 3 / 4 devices == chunked prefill: last logits and every layer's K, V."""
    model = create_model(TINY, seed=0)
    for n, t in ((2, 40), (3, 37), (4, 64)):
        tokens = rng.integers(0, 97, (2, t)).astype(np.int32)
        ref_logits, ref_cache = _chunked_reference(model, tokens, 128)
        logits, k, v, _ = ring_prefill(model, tokens, sequence_mesh(n))
        np.testing.assert_allclose(np.asarray(logits), ref_logits, atol=TOL, rtol=0)
        for i, layer in enumerate(ref_cache.layers):
            np.testing.assert_allclose(np.asarray(k[i]), np.asarray(layer["k"][:, :t]), atol=1e-5, rtol=0)
            np.testing.assert_allclose(np.asarray(v[i]), np.asarray(layer["v"][:, :t]), atol=1e-5, rtol=0)


def check_ring_prefill_into_modes(rng):
    """A prompt ring-prefilled on 2 devices, handed to full / hgca / topk (keep-all), then 64 decode
    steps that cross evictions: the logits of a plain chunked prefill + decode through `full`."""
    model = create_model(TINY, seed=0)
    prompt = rng.integers(0, 97, (1, 40)).astype(np.int32)
    continuation = rng.integers(0, 97, (1, 64)).astype(np.int32)
    reference = run_forced(model, make_backend("full"), prompt, continuation)[0]
    mesh = sequence_mesh(2)
    for mode in ("full", "hgca", "topk"):
        backend = make_backend(mode, **KEEP_ALL) if mode != "full" else make_backend("full")
        logits, cache = ring_prefill_cache(model, backend, prompt[0], mesh, max_len=128)
        step, params = make_step(model, backend)
        out = []
        for i in range(continuation.shape[1]):
            pos = np.full((1, 1), 40 + i, np.int32)
            cache = backend.before_step(cache, pos)
            logits, cache = step(params, continuation[:, i:i + 1], pos, cache)
            out.append(np.asarray(logits[:, 0]))
        np.testing.assert_allclose(np.stack(out, 1), reference, atol=TOL, rtol=0, err_msg=mode)
        if mode != "full":
            assert backend.counters()["n_evicted_blocks"] > 0
            backend.close()


def distributed_prompts(seed: int):
    """The two-process check's hgca prompt [2, 40] and forced continuation [2, 24]."""
    rng = np.random.default_rng(seed + 1)
    return rng.integers(0, 96, (2, 40)).astype(np.int32), rng.integers(0, 96, (2, 24)).astype(np.int32)


def forced_tp(model, backend, tp, prompt, continuation):
    """tests.hybrid_support.run_forced through TensorParallel at degree `tp` -> (logits [B, steps, V],
    counters, the open ShardedOffload; close it)."""
    parallel = TensorParallel(model, tensor_mesh(tp, model.config), backend)
    logits, sharded, cache, _ = run_forced(model, None, prompt, continuation, parallel=parallel)
    window = cache.layers[-1].window.k_ring
    assert len(window.sharding.device_set) == tp
    assert window.addressable_shards[0].data.shape[1] == model.config.num_kv_heads // tp
    for runtime in sharded.runtimes.values():  # each device's own host-store shard over its own heads
        assert runtime.store.config.n_kv_heads == model.config.num_kv_heads // tp
    return logits, sharded.counters(), sharded


def check_tensor_parallel_offload(rng, every_degree=False):
    """Every offloading mode at TP 2 == the single-device backend, over a 72-token prefill (whose
    last chunks attend blocks already offloaded) and 32 forced decode steps that cross evictions
    (2 -> 4 offloaded blocks per row and layer: every decode step has offloaded blocks to select
    from, as many as a 40-token prompt and 64 steps reach), with each mode's real policy; at TP 4
    (one KV head per device) hgca and scout, whose host sides are the exchange's two paths (context
    pages, chosen blocks + recalls), or every mode (every_degree: the slow check below); a
    Gemma-3-like model (sliding + global layers) in hgca and scout at TP 2."""
    model = create_model(TP_HYBRID, seed=1)
    prompt = rng.integers(0, 96, (2, 72)).astype(np.int32)
    continuation = rng.integers(0, 96, (2, 32)).astype(np.int32)
    for mode, settings in MODE_SETTINGS.items():
        config = dict(WINDOW, **settings)
        reference, backend, _, _ = run_forced(model, make_backend(mode, **config), prompt, continuation)
        backend.close()
        for tp in (2, 4) if every_degree or mode in ("hgca", "scout") else (2,):
            got, counters, sharded = forced_tp(model, make_backend(mode, **config), tp, prompt, continuation)
            sharded.close()
            np.testing.assert_allclose(got, reference, atol=TOL, rtol=0, err_msg=f"{mode} tp={tp}")
            assert counters["n_evicted_blocks"] > 0, (mode, tp)
            if mode == "scout":
                assert counters["n_recalls"] > 0, counters
    gemma = create_model(GEMMA3_LIKE, seed=3)
    prompt, continuation = prompt % 97, continuation % 97
    for mode in ("hgca", "scout"):
        config = dict(WINDOW, **MODE_SETTINGS[mode])
        reference, backend, _, _ = run_forced(gemma, make_backend(mode, **config), prompt, continuation)
        backend.close()
        got, counters, sharded = forced_tp(gemma, make_backend(mode, **config), 2, prompt, continuation)
        sharded.close()
        np.testing.assert_allclose(got, reference, atol=TOL, rtol=0, err_msg=f"gemma3-like {mode}")
        assert counters["n_evicted_blocks"] > 0


def check_tensor_parallel_offload_every_degree(rng):
    """check_tensor_parallel_offload with every mode at TP 2 and 4."""
    check_tensor_parallel_offload(rng, every_degree=True)


def _decode_tp(model, tp, tokens, steps):
    parallel = TensorParallel(model, tensor_mesh(tp, model.config))  # over jax.devices(): every process's
    step, params = parallel.make_step()
    cache = parallel.init_cache(tokens.shape[0], 128)
    pos = np.arange(tokens.shape[1])[None].repeat(tokens.shape[0], 0).astype(np.int32)
    logits, cache = step(params, tokens, pos, cache)
    out, nxt = [np.asarray(logits[:, -1])], np.asarray(logits[:, -1]).argmax(-1)
    for i in range(steps):
        pos = np.full((tokens.shape[0], 1), tokens.shape[1] + i, np.int32)
        logits, cache = step(params, nxt[:, None].astype(np.int32), pos, cache)
        out.append(np.asarray(logits[:, 0]))
        nxt = out[-1].argmax(-1)
    k = cache.layers[0]["k"]
    assert len(k.sharding.device_set) == tp
    if tp > 1:  # each device holds Hkv / tp heads of the cache
        assert k.sharding.spec[2] == "tp" and k.addressable_shards[0].data.shape[2] == k.shape[2] // tp
    return np.stack(out, 1)


def check_megatron_layout(model):
    """Every projection and MLP kernel is split over the devices (each holds 1/tp of it), the vocabulary
    where it divides; norms replicated. An oracle of names, independent of param_spec: a path error once
    left every parameter replicated, still exact and only slower."""
    from jhybrid.parallel.tensor import random_sharded_model

    column, row = {"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"}, {"o_proj", "down_proj"}
    for tp in (2, 4):
        mesh = tensor_mesh(tp, model.config)
        placed = TensorParallel(model, mesh).params
        built = nnx.split(random_sharded_model(model.config, 0, mesh))[1]
        for params in (placed, built):
            seen = 0
            for path, leaf in jax.tree_util.tree_leaves_with_path(params):
                text = jax.tree_util.keystr(path)
                shard = leaf.addressable_shards[0].data.shape
                module = next((m for m in column | row if f"['{m}']" in text), None)
                if module is not None and "['kernel']" in text:
                    axis = 1 if module in column else 0
                    expected = tuple(n // tp if i == axis else n for i, n in enumerate(leaf.shape))
                    assert shard == expected, (tp, text, shard, leaf.shape)
                    seen += 1
                elif "norm" in text:
                    assert shard == leaf.shape, (tp, text, shard)
            assert seen == 7 * model.config.num_layers, seen


def check_tensor_parallel(rng):
    """TP 2 and 4 == TP 1 (full) over a prefill and 64 greedy decode steps, 4 KV heads; bad meshes."""
    config = TP_CONFIG
    model = create_model(config, seed=1)
    tokens = rng.integers(0, 96, (2, 24)).astype(np.int32)
    one = _decode_tp(model, 1, tokens, 64)
    for tp in (2, 4):
        np.testing.assert_allclose(_decode_tp(model, tp, tokens, 64), one, atol=TOL, rtol=0, err_msg=f"tp={tp}")
    check_megatron_layout(model)
    odd = create_model(TINY.replace(vocab_size=97), seed=2)  # 97: embedding replicated, still exact
    np.testing.assert_allclose(_decode_tp(odd, 2, tokens % 97, 8), _decode_tp(odd, 1, tokens % 97, 8), atol=TOL)
    for tp, message in ((3, "does not divide the model's 4 KV heads"), (8, "> the model's 4 KV heads"),
                        (0, "expected a positive int")):
        try:
            tensor_mesh(tp, config)
        except ValueError as error:
            assert message in str(error), (tp, str(error))
        else:
            raise AssertionError(f"tp={tp} accepted")
    try:
        sequence_mesh(5)
    except ValueError as error:
        assert "only 4 are visible" in str(error)
    else:
        raise AssertionError("a mesh of 5 of 4 devices accepted")
    hybrid = create_model(TP_HYBRID, seed=1)
    sharded = TensorParallel(hybrid, tensor_mesh(4, hybrid.config), make_backend("hgca", **KEEP_ALL)).backend
    try:  # a model whose KV heads the mesh does not divide, handed to an opened mesh's backend
        sharded.open(hybrid.config.replace(num_heads=6, num_kv_heads=6), 1, 64)
    except ValueError as error:
        assert "does not divide the model's 6 KV heads" in str(error), str(error)
    else:
        raise AssertionError("6 KV heads over 4 devices accepted")
    try:
        ring_prefill_cache(hybrid, sharded, np.arange(8), sequence_mesh(2), 64)
    except ValueError as error:
        assert "tensor-parallel offloading backend is not supported" in str(error), str(error)
    else:
        raise AssertionError("a ring prefill into a tensor-parallel offloading backend accepted")
    try:
        sharded.before_step(None, np.zeros((1, 1), np.int32))
    except RuntimeError as error:
        assert "call backend.open" in str(error)
    else:
        raise AssertionError("a step before open accepted")


def check_generator_and_cli(rng):
    """Generator(parallel=TensorParallel) at TP 2 and 4 gives TP 1's greedy tokens (full and hgca);
    `jhybrid generate --tp` runs SmolLM2 (cut to 2 layers: its 3 KV heads, tokenizer and chat
    format, tests.hybrid_support.short_smollm2) over 3 devices, and refuses a degree the devices or
    the KV heads cannot take (one line, exit 2)."""
    from jhybrid import cli
    from jhybrid.cli import main
    from jhybrid.generation import Generator
    from tests.hybrid_support import short_smollm2

    short = short_smollm2()
    cli._load_with_progress = lambda name, dtype: short  # the 30 real layers only add compile time

    model = create_model(TP_HYBRID, seed=1)
    prompts = [rng.integers(0, 96, 40).tolist(), rng.integers(0, 96, 23).tolist()]
    for mode, settings in (("full", {}), ("hgca", dict(KEEP_ALL))):
        def tokens(tp):
            backend = make_backend(mode, **settings)
            if tp == 1:
                generator = Generator(model, backend, prefill_chunk=16)
            else:
                generator = Generator(model, prefill_chunk=16,
                                      parallel=TensorParallel(model, tensor_mesh(tp, model.config), backend))
            with generator:
                return generator.generate(prompts, max_new_tokens=12).tokens
        one = tokens(1)
        for tp in (2, 4):
            assert tokens(tp) == one, (mode, tp)
    import contextlib
    import io

    def generate(tp):  # SmolLM2's shape: 3 KV heads
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(["generate", "--tp", tp, "--max-tokens", "4", "--mode", "hgca", "--window-tokens", "48",
                         "hello"])
        return code, err.getvalue()

    code, err = generate("3")
    assert code == 0 and "decode" in err, err
    for tp, message in (("2", "does not divide the model's 3 KV heads"), ("8", "only 4 cpu device(s) visible"),
                        ("0", "expected a positive int")):
        code, err = generate(tp)
        assert code == 2 and message in err and "Traceback" not in err, (tp, err)


def check_bench_tp(rng):
    """`parallel.tp` in a run config: `jhybrid bench` runs a throughput point over 1 and 2 devices for
    full and hgca, rows carry `tp`; a degree beyond the devices and a synthetic fill at tp 2 are
    one-line errors naming parallel.tp."""
    import tempfile

    from jhybrid.bench.runner import run_sweep
    from jhybrid.config.loading import config_from_dict

    doc = {"name": "tp-check", "model": {"name": "tiny", "dtype": "float32"},
           "offload": {"window_tokens": 32, "block_size": 16, "host_threads": 1},
           "benchmark": {"task": "throughput", "fill": "prefill", "batch": 2, "context": 64, "decode_tokens": 4,
                         "prefill_repeats": 1, "prefill_chunk": 32, "host_memory_gib": 8.0, "host_reserve_gib": 1.0,
                         "device_memory_gib": 8.0},
           "sweep": [{"offload.mode": ["full", "hgca"], "parallel.tp": [1, 2]}]}
    with tempfile.TemporaryDirectory() as folder:
        outcome = run_sweep(config_from_dict(doc), output_dir=folder, show_progress=False)
        rows = outcome.rows
    by = {(r["mode"], r["tp"]): r for r in rows}
    assert set(by) == {("full", 1), ("full", 2), ("hgca", 1), ("hgca", 2)}, [(r.get("mode"), r.get("tp"), r.get("error")) for r in rows]
    for row in rows:
        assert row.get("error") is None and row["decode_tok_s"] > 0, row
    from jhybrid.bench.runner import check_inputs
    from jhybrid.config.sweep import expand_sweep

    for change, message in (({"parallel": {"tp": 8}}, "parallel.tp = 8 but only 4 cpu device(s)"),
                            ({"parallel": {"tp": 2}, "benchmark": {**doc["benchmark"], "fill": "synthetic"}},
                             "parallel.tp = 2 runs throughput points with fill: prefill only")):
        bad = {**{k: v for k, v in doc.items() if k != "sweep"}, **change}
        bad["offload"] = {**doc["offload"], "mode": "hgca"}
        try:
            check_inputs(expand_sweep(config_from_dict(bad)))
        except ValueError as error:
            assert message in str(error) and "\n" not in str(error), str(error)
        else:
            raise AssertionError(f"no error for {change}")


if __name__ == "__main__":
    name, seed = sys.argv[1], int(sys.argv[2])
    assert len(jax.devices()) == 4, jax.devices()
    globals()[f"check_{name}"](np.random.default_rng(seed))
    print("OK", name)
