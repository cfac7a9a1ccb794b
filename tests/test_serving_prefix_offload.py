"""The serving engine's prefix cache with the offloading modes (jhybrid/serving/engine.py +
jhybrid/hybrid/ingest.py) on the tiny model (CPU):

  * `place_history` into one row of an open 2-row batch leaves that row as a plain chunked prefill
    of the same tokens does (host store blocks, sinks + ring, digests and scout's layer-ahead copy,
    recall's mirror, token and block counts), and the other row, mid-sequence, is untouched;
  * through the engine (hgca with a real salience threshold, scout with the layer-ahead query and
    recalls; slow: topk, and scout on a Gemma-3-like model with sliding-window layers): requests sharing a prefix give exactly the greedy tokens of each request run
    alone without a prefix cache; a hit (cached_tokens > 0, placed while another row decodes, whose
    output also equals its run alone), a partial match and misses; hgca's hit is bounded so that it
    stays exact (`ingest.reusable_prefix`: its prompt's own prefill must evict every placed ring
    token and prefill its last reevaluate_queries tokens).

The policy is the one of tests/test_hybrid_reset_rows.py (eviction_spread off, eviction lag 0;
scout recalls on a batch-independent schedule): a row then runs as it would alone.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jhybrid.generation import make_step
from jhybrid.hybrid import make_backend
from jhybrid.hybrid.ingest import place_history, read_tokens, reusable_prefix
from jhybrid.models import create_model
from jhybrid.serving.api import Request
from jhybrid.serving.engine import ServingEngine
from jhybrid.serving.prefix_cache import PrefixCacheConfig
from tests.hybrid_support import TINY

SLOTS, MAX_LEN, CHUNK, BLOCK = 2, 160, 16, 16
BLOCK_BYTES = TINY.num_layers * 2 * BLOCK * TINY.num_kv_heads * TINY.head_dim * 4  # float32
POLICY = dict(window_tokens=40, block_size=16, sink=8, host_threads=1, eviction_spread=False, eviction_lag_steps=0)
MODES = {
    "hgca": dict(mode="hgca", beta=1.0, alpha=0.3),  # a real salience threshold
    "scout": dict(mode="scout", budget=32, recall_blocks=2, recall_threshold=0.0, recall_min_interval=1,
                  recall_lag_steps=1, scout_exact_layers=1),  # layer 1 selects with the predicted query
    "topk": dict(mode="topk", budget=32),  # 2 of the offloaded blocks
}


@pytest.fixture(scope="module")
def model():
    return create_model(TINY, seed=0)


def backend_of(name, **extra):
    options = {**POLICY, **MODES.get(name, {"mode": name}), **extra}
    return make_backend(options.pop("mode"), **options)


# ----------------------------------------------------------------------------- placement into a row


def prefill_row(backend, step, cache, row, tokens, start=0):
    """Prefills tokens into `row` from position `start`, in chunks of CHUNK (the other row padded)."""
    for begin in range(0, len(tokens), CHUNK):
        part = tokens[begin:begin + CHUNK]
        toks = np.zeros((SLOTS, CHUNK), np.int32)
        pos = np.full((SLOTS, CHUNK), -1, np.int32)
        toks[row, :len(part)] = part
        pos[row, :len(part)] = start + begin + np.arange(len(part))
        cache = backend.before_step(cache, pos)
        _, cache = step[0](step[1], toks, pos, cache)
    return cache


def row_arrays(cache, row):
    """Every batch-major array of the cache's row `row` (state arrays, lengths) as NumPy."""
    out = []
    for state in cache.layers:
        for x in jax.tree_util.tree_leaves(state.replace(offloaded=None)):
            m = x.shape[0] // SLOTS
            out.append(np.asarray(x[row * m:(row + 1) * m]))
    return out + [np.asarray(cache.lengths[row])]


@pytest.mark.parametrize("name", ["scout", "recall"])
def test_placed_row_equals_a_plain_prefill_and_the_other_row_is_untouched(model, rng, name):
    # scout with the layer-ahead query: layer 1's digests live in layer 0's next_digests
    options = {"scout_exact_layers": 0, "budget": 16} if name == "scout" else {}
    backend = backend_of(name, **options)
    step = make_step(model, backend)
    n = 74  # 8 sinks + 3 offloaded blocks of 16 + 18 ring tokens
    tokens = rng.integers(0, TINY.vocab_size, n).astype(np.int32)
    other = rng.integers(0, TINY.vocab_size, 50).astype(np.int32)

    # the reference: a plain prefill of the tokens into row 1, its K, V read from the window after
    # each chunk as the engine reads them
    backend.open(model.config, SLOTS, MAX_LEN)
    want = model.init_cache(SLOTS, MAX_LEN, backend)
    kv = np.zeros((TINY.num_layers, 2, 0, TINY.num_kv_heads, TINY.head_dim), np.float32)
    for begin in range(0, n, CHUNK):
        want = prefill_row(backend, step, want, 1, tokens[begin:begin + CHUNK], start=begin)
        kv = np.concatenate([kv, read_tokens(backend, want, 1, begin, min(CHUNK, n - begin), CHUNK)], axis=2)
    want_runtime = backend.runtime
    want_runtime.evictor.publish_all()
    want_blocks = [want_runtime.store.read_blocks(layer, 1) for layer in range(TINY.num_layers)]
    want_mirror = [np.array(want_runtime.mode_host.mirror_k[:, 1])] if name == "recall" else []

    # row 0 mid-sequence, row 1 used and reset, then the history placed into row 1
    backend = backend_of(name, **options)
    step = make_step(model, backend)
    backend.open(model.config, SLOTS, MAX_LEN)
    cache = model.init_cache(SLOTS, MAX_LEN, backend)
    cache = prefill_row(backend, step, cache, 0, other)
    cache = prefill_row(backend, step, cache, 1, other[:40])
    cache = backend.reset_rows(cache, np.array([1]))
    before = row_arrays(cache, 0)
    runtime = backend.runtime
    counts = (runtime.n_tokens[0], runtime.evictor.published[0], runtime.evictor.started[0],
              runtime.store.n_blocks(0, 0))
    got = place_history(backend, model.config, cache, 1, kv)

    for x, y in zip(before, row_arrays(got, 0)):  # row 0 untouched, on the device and the host
        np.testing.assert_array_equal(x, y)
    assert counts == (runtime.n_tokens[0], runtime.evictor.published[0], runtime.evictor.started[0],
                      runtime.store.n_blocks(0, 0))
    cfg = backend.config
    e = -(-(n - cfg.sink - cfg.ring_tokens) // cfg.block_size)
    assert int(got.lengths[1]) == n and runtime.n_tokens[1] == n
    assert runtime.evictor.published[1] == runtime.evictor.started[1] == e == 3
    assert int(got.meta.offloaded_blocks[1]) == e
    for layer in range(TINY.num_layers):
        mine = runtime.store.read_blocks(layer, 1)
        for key in ("k", "v", "positions"):
            np.testing.assert_array_equal(mine[key], want_blocks[layer][key])
        a, b = got.layers[layer], want.layers[layer]
        # sinks and the ring tokens a prefill leaves attended: [sink + e * bs, n)
        np.testing.assert_array_equal(np.asarray(a.window.sink_k[1]), np.asarray(b.window.sink_k[1]))
        np.testing.assert_array_equal(np.asarray(a.window.sink_v[1]), np.asarray(b.window.sink_v[1]))
        slots = (np.arange(cfg.sink + e * cfg.block_size, n) - cfg.sink) % cfg.ring_capacity
        for x, y in ((a.window.k_ring, b.window.k_ring), (a.window.v_ring, b.window.v_ring)):
            np.testing.assert_array_equal(np.asarray(x[1][:, slots]), np.asarray(y[1][:, slots]))
        for group in ("digests", "next_digests"):
            if getattr(b, group) is not None:
                for x, y in ((getattr(a, group).kmin, getattr(b, group).kmin),
                             (getattr(a, group).kmax, getattr(b, group).kmax)):
                    np.testing.assert_array_equal(np.asarray(x[1]), np.asarray(y[1]))
    if name == "scout":
        assert got.layers[0].next_digests is not None and np.asarray(got.layers[0].next_digests.kmin[1]).any()
    if name == "recall":
        np.testing.assert_array_equal(runtime.mode_host.mirror_k[:, 1], want_mirror[0])


def test_reusable_prefix_bounds_hgca_only():
    hgca, scout = backend_of("hgca"), backend_of("scout")
    # 85 tokens: its prefill evicts 3 blocks (sink 8 + 48 tokens) and must prefill its last 16
    assert reusable_prefix(scout, 85, 80, CHUNK, BLOCK) == 80
    assert reusable_prefix(hgca, 85, 80, CHUNK, BLOCK) == 48
    assert reusable_prefix(hgca, 85, 80, 32, BLOCK) == 32  # on a chunk boundary of 32
    assert reusable_prefix(hgca, 110, 96, CHUNK, BLOCK) == 80
    assert reusable_prefix(hgca, 20, 16, CHUNK, BLOCK) == 0  # its last 16 tokens must be prefilled


# ----------------------------------------------------------------------------- through the engine


def run_all(engine, handles):
    while not all(h.done for h in handles):
        engine.step()
    return [h.result(0) for h in handles]


def alone(model, backend, requests) -> list:
    """The output of each (prompt, max_tokens) of `requests` run alone, in order, through an engine
    of the same shape without a prefix cache."""
    engine = ServingEngine(model, backend, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK, prefix_cache=None)
    with engine:
        return [run_all(engine, [engine.submit(Request(prompt, max_tokens=m))])[0] for prompt, m in requests]


def scenario(engine, prompts, max_tokens):
    """A alone; C starts, B (sharing A's prefix) is admitted while C decodes; then D (partial
    match), E (a miss), F (A's prefix + 5 tokens). Deterministic: the caller's thread steps."""
    a, b, c, d, e, f = prompts
    outs = {"A": run_all(engine, [engine.submit(Request(a, max_tokens=max_tokens))])[0]}
    handle_c = engine.submit(Request(c, max_tokens=30))
    for _ in range(6):  # C's prefill (4 chunks) and its first decode steps
        engine.step()
    assert not handle_c.done and engine.slot_lengths()[0] > len(c)  # C decodes in row 0
    handle_b = engine.submit(Request(b, max_tokens=max_tokens))
    outs["C"], outs["B"] = run_all(engine, [handle_c, handle_b])
    for key, prompt in (("D", d), ("E", e), ("F", f)):
        outs[key] = run_all(engine, [engine.submit(Request(prompt, max_tokens=max_tokens))])[0]
    return outs


@pytest.mark.parametrize("name", ["hgca", "scout", pytest.param("topk", marks=pytest.mark.slow)])
def test_prefix_hits_give_the_tokens_of_running_alone(model, rng, name):
    shared = rng.integers(0, TINY.vocab_size, 80).tolist()
    new = lambda n: rng.integers(0, TINY.vocab_size, n).tolist()  # noqa: E731
    prompts = [shared + new(20), shared + new(30), new(60), shared[:40] + new(50), new(50), shared + new(5)]
    backend = backend_of(name)
    engine = ServingEngine(model, backend, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           prefix_cache=PrefixCacheConfig(block_size=BLOCK, device_bytes=64 * BLOCK_BYTES))
    with engine:
        outs = scenario(engine, prompts, max_tokens=20)
        stats = engine.stats()
        assert backend.counters()["n_evicted_blocks"] > 0
    hit_f = 48 if name == "hgca" else 80  # hgca: F's prefill must evict every placed ring token
    assert {k: o.cached_tokens for k, o in outs.items()} == dict(A=0, B=80, C=0, D=32, E=0, F=hit_f)
    assert (stats.prefix_hits, stats.prefix_misses, stats.prefix_hit_tokens) == (3, 3, 80 + 32 + hit_f)
    assert stats.prefix_bytes_device == (6 + 1 + 3 + 3 + 3) * BLOCK_BYTES  # A, B, C, D, E's new blocks (host pool)

    wants = alone(model, backend, [(prompt, 30 if key == "C" else 20) for key, prompt in zip("ABCDEF", prompts)])
    for key, want in zip("ABCDEF", wants):
        assert outs[key].tokens == want.tokens, f"{name}: request {key} differs from its run alone"
        assert outs[key].finish_reason == want.finish_reason


@pytest.mark.slow  # ~40 s on the 2-core machine: one more model's compiles
def test_a_hit_with_sliding_window_layers(rng):
    """Gemma-3-like (sliding layers of window 24 between the global ones): a hit's sliding rings get
    the prefix's last 24 tokens, read from the rings as they were prefilled; outputs equal alone."""
    from tests.hybrid_support import GEMMA3_LIKE

    model = create_model(GEMMA3_LIKE, seed=0)
    shared = rng.integers(0, GEMMA3_LIKE.vocab_size, 64).tolist()
    prompts = [shared + rng.integers(0, GEMMA3_LIKE.vocab_size, n).tolist() for n in (20, 11)]
    backend = backend_of("scout")
    config = PrefixCacheConfig(block_size=BLOCK, device_bytes=16 * GEMMA3_LIKE.num_layers * 2 * BLOCK
                               * GEMMA3_LIKE.num_kv_heads * GEMMA3_LIKE.head_dim * 4)
    engine = ServingEngine(model, backend, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK, prefix_cache=config)
    with engine:
        outs = [run_all(engine, [engine.submit(Request(p, max_tokens=16))])[0] for p in prompts]
    assert [o.cached_tokens for o in outs] == [0, 64]
    assert [o.tokens for o in outs] == [w.tokens for w in alone(model, backend, [(p, 16) for p in prompts])]


def test_a_prompt_enters_the_prefix_cache_as_it_is_prefilled(model, rng, monkeypatch):
    """An offloading backend stores each prefill call's whole blocks in the prefix cache after the
    call (not the whole prompt when its prefill ends: one 2 s step at 16K on the 8B shape), once the
    next call is dispatched (the device runs it while the host stores): after the k-th call of 16
    tokens the cache holds k - 1 blocks, after the 4-token last call all 6 (96 of 100 tokens are whole
    blocks; that call adds none). A second request of the same prompt then hits all 6 blocks' worth the
    hgca bound allows, and both give the tokens of the prompt run alone."""
    from jhybrid.serving import engine as engine_module

    monkeypatch.setattr(engine_module, "STORE_BACKLOG", 0)  # each step ends with its stores done: the stats count them
    prompt = rng.integers(0, TINY.vocab_size, 100).tolist()
    backend = backend_of("hgca")
    engine = ServingEngine(model, backend, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           prefix_cache=PrefixCacheConfig(block_size=BLOCK, device_bytes=64 * BLOCK_BYTES))
    with engine:
        handle = engine.submit(Request(prompt, max_tokens=6))
        blocks = []
        while len(blocks) < 7:  # the 7 prefill steps (6 x 16 tokens + 4)
            engine.step()
            blocks.append(engine.stats().prefix_bytes_device // BLOCK_BYTES)
        first = run_all(engine, [handle])[0]
        again = run_all(engine, [engine.submit(Request(prompt, max_tokens=6))])[0]
    assert blocks == [0, 1, 2, 3, 4, 5, 6]
    assert again.cached_tokens == reusable_prefix(backend, len(prompt), 96, CHUNK, BLOCK) > 0
    (want,) = alone(model, backend, [(prompt, 6)])
    assert first.tokens == want.tokens and again.tokens == want.tokens


def test_a_step_ends_while_its_store_jobs_run_and_an_admission_waits_for_them(model, rng, monkeypatch):
    """The prefix-cache store jobs overlap the next steps' calls: a step ends with up to
    STORE_BACKLOG of them still running (held here), and waits only for the ones beyond. A request's
    admission waits for every job (its lookup must see every block prefilled so far): the lookup finds
    none running and hits what the held jobs stored; both requests give the tokens of the prompt
    run alone. Bounded joins: a step that waited for a held job would fail the join, not hang."""
    import threading

    from jhybrid.serving import engine as engine_module

    release = threading.Event()
    original_job, original_place = ServingEngine._store_job, ServingEngine._place_cached_prefix

    def held_job(self, jobs):
        assert release.wait(120), "the test never released the store jobs"
        return original_job(self, jobs)

    running_at_lookup = []

    def place(self, run):
        running_at_lookup.append(sum(not future.done() for future in self._stores))
        return original_place(self, run)

    monkeypatch.setattr(ServingEngine, "_store_job", held_job)
    monkeypatch.setattr(ServingEngine, "_place_cached_prefix", place)
    prompt = rng.integers(0, TINY.vocab_size, 100).tolist()
    backend = backend_of("scout")
    engine = ServingEngine(model, backend, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           prefix_cache=PrefixCacheConfig(block_size=BLOCK, device_bytes=64 * BLOCK_BYTES))
    with engine:
        first = engine.submit(Request(prompt, max_tokens=6))
        # one 16-token call a step; a call's captures are submitted after the next call's dispatch:
        # steps 2 and 3 each submit a job and end with it held (STORE_BACKLOG = 2)
        stepping = threading.Thread(target=lambda: [engine.step() for _ in range(1 + engine_module.STORE_BACKLOG)])
        stepping.start()
        stepping.join(120)
        assert not stepping.is_alive(), "a step waited for a store job within the backlog"
        assert sum(not future.done() for future in engine._stores) == engine_module.STORE_BACKLOG
        second = engine.submit(Request(prompt, max_tokens=6))  # admitted in the next step (row 1 is free)
        stepping = threading.Thread(target=engine.step)
        stepping.start()
        release.set()
        stepping.join(120)
        assert not stepping.is_alive()
        outs = run_all(engine, [first, second])
    assert running_at_lookup[1] == 0  # the second request's lookup, after every held job ended
    assert outs[1].cached_tokens > 0
    (want,) = alone(model, backend, [(prompt, 6)])
    assert [o.tokens for o in outs] == [want.tokens] * 2


def test_a_prompt_whose_cached_blocks_are_evicted_mid_prefill_stops_being_stored(model, rng):
    """Two prompts prefilled side by side into a 4-block tier: each call's insert evicts the other
    prompt's least recent blocks, so a prompt's earlier blocks vanish while it is still prefilled.
    Its later blocks are then not stored (they could never be matched: the engine stops capturing
    it, so the prompt asked again hits at most its first block); nothing fails, the tier never holds more than its 4 blocks, and the outputs are those of each
    prompt run alone."""
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (90, 70)]
    backend = backend_of("scout")
    engine = ServingEngine(model, backend, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           step_token_budget=SLOTS * CHUNK,  # both rows prefill in every step
                           prefix_cache=PrefixCacheConfig(block_size=BLOCK, device_bytes=4 * BLOCK_BYTES))
    with engine:
        handles = [engine.submit(Request(p, max_tokens=6)) for p in prompts]
        held = []
        while not all(h.done for h in handles):
            engine.step()
            held.append(engine.stats().prefix_bytes_device // BLOCK_BYTES)
        outs = [h.result(0) for h in handles]
        # the second prompt lost its first blocks' chain at 32 tokens: at most its first block is left
        again = run_all(engine, [engine.submit(Request(prompts[1], max_tokens=6))])[0]
    assert max(held) == 4
    assert again.cached_tokens <= BLOCK and again.tokens == outs[1].tokens
    assert [o.tokens for o in outs] == [w.tokens for w in alone(model, backend, [(p, 6) for p in prompts])]


def test_row_resets_compile_once_whatever_step_came_before(model, rng):
    """`reset_rows` runs after any kind of step: a decode call, or a prefill call whose layer states
    carry that step's device copies of the offloaded prompt (`prefill_offloaded="device"`) or the
    nothing-offloaded marker. The copies stay outside its jitted call, so it compiles once (each
    kind of step was a compile of its own under load: 2.6 s a step at the 8B shape). Requests of
    ragged lengths through two slots end after decode and prefill steps alike; their outputs equal
    each one run alone."""
    from jhybrid.hybrid import rows

    backend = backend_of("scout", prefill_offloaded="device")
    prompts = [rng.integers(0, TINY.vocab_size, n).tolist() for n in (20, 120, 37)]
    rows._reset.clear_cache()
    engine = ServingEngine(model, backend, slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK, prefix_cache=None)
    with engine:
        handles = [engine.submit(Request(p, max_tokens=3 + i)) for i, p in enumerate(prompts)]
        outs = run_all(engine, handles)
        log = engine.step_log()
    assert engine.stats().finished == len(prompts)
    # the step each request ended in (its last token: a decode) ran a prefill call too, or did not:
    # both kinds came before a reset
    last_steps = [max((r for r in log if h.request_id in r.decode), key=lambda r: r.step) for h in handles]
    assert {bool(r.prefill) for r in last_steps} == {True, False}, [(r.step, r.prefill) for r in last_steps]
    assert rows._reset._cache_size() == 1
    wants = alone(model, backend, [(p, 3 + i) for i, p in enumerate(prompts)])
    assert [o.tokens for o in outs] == [w.tokens for w in wants]


def test_a_failing_store_job_fails_the_step_and_ends_every_request(model, rng, monkeypatch):
    """The prefix-cache stores run on the engine's store worker: a store that raises there (a failed
    copy, a full disk) fails the step that joins it, on the stepping thread; every request then ends
    with ERROR naming the error and the engine refuses new ones. Nothing hangs: the engine steps on
    this thread and each wait is on a job that has ended."""
    from jhybrid.serving.api import EngineClosed, FinishReason

    def failing(self, run):
        raise OSError("injected store failure")

    monkeypatch.setattr(ServingEngine, "_store_staged", failing)
    engine = ServingEngine(model, backend_of("hgca"), slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           prefix_cache=PrefixCacheConfig(block_size=BLOCK, device_bytes=64 * BLOCK_BYTES))
    with engine:
        handles = [engine.submit(Request(rng.integers(0, TINY.vocab_size, n).tolist(), max_tokens=4))
                   for n in (70, 40)]
        with pytest.raises(OSError, match="injected store failure"):
            for _ in range(20):  # bounded: the second prefill call submits the first store job
                engine.step()
        outs = [h.result(0) for h in handles]
        assert [o.finish_reason for o in outs] == [FinishReason.ERROR] * 2
        assert all("injected store failure" in o.error for o in outs)
        with pytest.raises(EngineClosed, match="injected store failure"):
            engine.submit(Request([1, 2, 3], max_tokens=2))


# ----------------------------------------------------------------------------- batched window reads


def filled_cache(model, backend, batch, rng):
    """An open batch of `batch` rows whose every floating array (windows, sinks, sliding rings) holds
    random values: a read is a pure gather, so any content tells its rows and positions apart."""
    backend.open(model.config, batch, MAX_LEN)
    cache = model.init_cache(batch, MAX_LEN, backend)

    def fill(x):
        if isinstance(x, jax.Array) and jax.numpy.issubdtype(x.dtype, jax.numpy.floating):
            return jax.numpy.asarray(rng.standard_normal(x.shape), x.dtype)
        return x

    return cache.replace(layers=jax.tree_util.tree_map(fill, cache.layers))


def window_tokens(backend, cache, row, start, count):
    """K, V [L, 2, count, Hkv, D] of row `row` at start .. start + count - 1, gathered in NumPy from
    the windows as a prefill leaves them (sinks, ring slot (p - sink) % capacity; sliding: p % W)."""
    cfg = backend.config
    out = []
    for state in cache.layers:
        positions = np.arange(start, start + count)
        if hasattr(state, "window"):
            w = state.window
            ring = (positions - cfg.sink) % cfg.ring_capacity
            kv = [np.asarray(x[row])[:, ring] for x in (w.k_ring, w.v_ring)]  # [Hkv, count, D]
            for x, sink in zip(kv, (w.sink_k, w.sink_v)):
                in_sink = positions < cfg.sink
                x[:, in_sink] = np.asarray(sink[row])[:, positions[in_sink]]
            kv = [x.transpose(1, 0, 2) for x in kv]
        else:  # a sliding-window layer
            kv = [np.asarray(x[row])[positions % x.shape[1]] for x in (state.k, state.v)]
        out.append(np.stack(kv))
    return np.stack(out)


@pytest.mark.parametrize("config", ["tiny", "gemma3_like"])
def test_a_batched_read_equals_each_row_read_alone(model, rng, config):
    """`start_read_rows` of 3 rows of a batch of 4 (padded to 4: the padding reads rows[0]), ragged
    starts (sinks, ring wrap-around) and counts (one below the width): each row's array is bit for bit
    that row's `read_tokens` and the windows' tokens; fewer rows pad to 1, 2 and 4."""
    from jhybrid.hybrid import ingest
    from tests.hybrid_support import GEMMA3_LIKE

    if config == "gemma3_like":  # sliding-window layers (window 24) between the global ones
        model = create_model(GEMMA3_LIKE, seed=0)
    backend = backend_of("scout")
    cache = filled_cache(model, backend, 4, rng)
    # row 3 from the sinks on; row 0 across the ring's end (ring capacity 96: slots 92 .. 95, 0 .. 11)
    rows, starts, counts = [3, 0, 2], [0, 100, 5], [CHUNK, CHUNK, 7]
    ingest._read_rows.clear_cache()
    reads = ingest.start_read_rows(backend, cache, rows, starts, counts, CHUNK)
    assert [read.count for read in reads] == counts
    for read, row, start, count in zip(reads, rows, starts, counts):
        got = read()
        alone_ = read_tokens(backend, cache, row, start, count, CHUNK)
        assert got.shape == (model.config.num_layers, 2, count, model.config.num_kv_heads, model.config.head_dim)
        assert got.dtype == alone_.dtype
        np.testing.assert_array_equal(got, alone_)
        np.testing.assert_array_equal(got, window_tokens(backend, cache, row, start, count))
    assert [ingest.read_rows_padded(n, 4) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert ingest.read_rows_padded(5, 6) == 6
    (single,) = ingest.start_read_rows(backend, cache, [1], [20], [3], CHUNK)
    np.testing.assert_array_equal(single(), window_tokens(backend, cache, 1, 20, 3))
    assert ingest._read_rows._cache_size() == 2  # 4 rows (3 padded) and 1 row: one compile each


def test_a_batched_read_refuses_bad_inputs(model, rng):
    from jhybrid.hybrid.ingest import start_read_rows

    backend = backend_of("scout")
    cache = filled_cache(model, backend, SLOTS, rng)
    with pytest.raises(ValueError, match="0 tokens of row 0 in a read of width 16"):
        start_read_rows(backend, cache, [0], [0], [0], CHUNK)
    with pytest.raises(ValueError, match="17 tokens of row 1 in a read of width 16"):
        start_read_rows(backend, cache, [0, 1], [0, 0], [4, 17], CHUNK)
    with pytest.raises(ValueError, match="2 rows, 1 starts and 2 counts"):
        start_read_rows(backend, cache, [0, 1], [0], [4, 4], CHUNK)
    with pytest.raises(ValueError, match="no rows"):
        start_read_rows(backend, cache, [], [], [], CHUNK)
    with pytest.raises(ValueError, match="row 2 is out of range for a batch of 2"):
        start_read_rows(backend, cache, [2], [0], [1], CHUNK)
    with pytest.raises(ValueError, match="3 rows read from a batch of 2"):
        start_read_rows(backend, cache, [0, 1, 0], [0, 0, 0], [1, 1, 1], CHUNK)


def test_a_prefill_call_reads_the_captures_of_all_its_rows_at_once(model, rng, monkeypatch):
    """An offloading backend's prefill call stages the new whole blocks of every row it prefilled
    with ONE window read (`ingest.start_read_rows`), not one per request: two prompts (70 and 50
    tokens) prefilled side by side in calls of 16 tokens a row read rows [0, 1] after each of the
    first 3 calls, row 0 alone after the 4th (the 50-token prompt's whole blocks end at 48), nothing
    after the 5th; their 4 + 3 whole blocks enter the prefix cache."""
    from jhybrid.hybrid import ingest

    reads = []
    start_read_rows = ingest.start_read_rows

    def counted(backend, cache, rows, starts, counts, width):
        reads.append((list(rows), list(starts), list(counts)))
        return start_read_rows(backend, cache, rows, starts, counts, width)

    monkeypatch.setattr(ingest, "start_read_rows", counted)
    engine = ServingEngine(model, backend_of("scout"), slots=SLOTS, max_len=MAX_LEN, prefill_chunk=CHUNK,
                           step_token_budget=SLOTS * CHUNK,  # both rows prefill in every step
                           prefix_cache=PrefixCacheConfig(block_size=BLOCK, device_bytes=64 * BLOCK_BYTES))
    with engine:
        run_all(engine, [engine.submit(Request(rng.integers(0, TINY.vocab_size, n).tolist(), max_tokens=4))
                         for n in (70, 50)])
        engine.step()  # out of work: the last store jobs joined
        stored = engine.stats().prefix_bytes_device // BLOCK_BYTES
    assert reads == [([0, 1], [0, 0], [16, 16]), ([0, 1], [16, 16], [16, 16]), ([0, 1], [32, 32], [16, 16]),
                     ([0], [48], [16])]
    assert stored == 4 + 3
