"""Shared helpers of the hybrid-mode tests: the tiny model shape, keep-everything settings and a
teacher-forced runner through any backend (imported by the test modules; not a test module)."""

from __future__ import annotations

import os

import numpy as np

from jhybrid.generation import make_step
from jhybrid.hcache import HCacheEngine
from jhybrid.models import ModelConfig

TINY = ModelConfig(family="llama", vocab_size=97, d_model=128, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=64, mlp_dim=128, max_position_embeddings=256)
# Window 40 = 8 sinks + 2 blocks of 16 (max prefill chunk 16); scout / topk select every block
# (budget None). beta -> 0 keeps every offloaded token.
WINDOW = dict(window_tokens=40, block_size=16, sink=8, host_threads=1, budget=None)
KEEP_ALL = dict(WINDOW, beta=1e-30)
SCOUT_RECALLS = dict(recall_blocks=2, recall_min_interval=2, recall_threshold=0.0)
CHUNK, MAX_LEN = 16, 128


def window_only_chunks(lengths, chunk: int = CHUNK, window: int = WINDOW["window_tokens"]) -> int:
    """Oracle: of prompts of `lengths` tokens prefilled together in chunks, the chunks after which
    every row that took part holds at most `window` tokens: nothing offloaded, so they attend to the
    GPU window alone and make no host call (`NothingOffloaded`)."""
    lengths = [lengths] if isinstance(lengths, int) else list(lengths)
    count = 0
    for end in range(chunk, max(lengths) + chunk, chunk):
        held = [min(end, n) for n in lengths if end - chunk < n]
        count += max(held) <= window
    return count
TOL = 2e-4
# A Gemma-3-like model: sliding layers (window 24) and global layers alternating.
GEMMA3_LIKE = ModelConfig(
    family="gemma3", vocab_size=97, d_model=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
    mlp_dim=128, max_position_embeddings=256, mlp_type="geglu", sliding_window=24,
    layer_types=("sliding_attention", "full_attention", "sliding_attention", "full_attention"),
    rope_theta=1e6, rope_local_theta=1e4, qk_norm=True, sandwich_norm=True, embed_scale=128 ** 0.5,
    query_pre_attn_scalar=64.0, final_logit_softcap=30.0)


def xla_flags(devices: int) -> str:
    """This run's XLA_FLAGS (tests/conftest.py's compile setting) with `devices` virtual CPU devices,
    for a subprocess."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()


def wait_recalls(backend) -> None:
    """Block until scout's in-flight recalls are staged (the next decode step start applies them); a
    tensor-parallel backend's on every shard."""
    shards = getattr(backend, "runtimes", None)
    for runtime in shards.values() if shards else [getattr(backend, "runtime", None)]:
        wait = getattr(getattr(runtime, "mode_host", None), "wait", None)
        if wait is not None:
            wait()


def run_forced(model, backend, prompt, continuation, turns=(), chunk=CHUNK, max_len=MAX_LEN, parallel=None):
    """Teacher-forced: prefill `prompt` [B, P] in chunks, then one token per step; each (at_step,
    tokens [B, T]) of `turns` is appended as a new chunk before that decode step. Returns (logits of
    every decode step [B, steps, V], backend, final cache, tokens held). `parallel`: a
    jhybrid.parallel.TensorParallel whose step, cache and backend run instead (`backend` unused).

    Background recalls (scout) are waited for before each decode step start, so a recall triggered
    at one step start is applied at the next: the run never depends on timing."""
    batch = prompt.shape[0]
    if parallel is not None:
        backend = parallel.backend
        step, params = parallel.make_step()
        backend.open(model.config, batch, max_len)
        cache = parallel.init_cache(batch, max_len)
    else:
        step, params = make_step(model, backend)
        backend.open(model.config, batch, max_len)
        cache = model.init_cache(batch, max_len, backend)
    held = 0

    def chunk_in(cache, toks, held):
        for s in range(0, toks.shape[1], chunk):
            part = toks[:, s:s + chunk]
            pos = held + s + np.arange(part.shape[1])[None].repeat(batch, 0)
            pad = chunk - part.shape[1]
            part = np.pad(part, ((0, 0), (0, pad)))
            pos = np.pad(pos, ((0, 0), (0, pad)), constant_values=-1).astype(np.int32)
            cache = backend.before_step(cache, pos)
            _, cache = step(params, part, pos, cache)
        return cache, held + toks.shape[1]

    cache, held = chunk_in(cache, prompt, held)
    turns = dict(turns)
    out = []
    for i in range(continuation.shape[1]):
        if i in turns:
            cache, held = chunk_in(cache, turns[i], held)
        pos = np.full((batch, 1), held, np.int32)
        wait_recalls(backend)
        cache = backend.before_step(cache, pos)
        logits, cache = step(params, continuation[:, i:i + 1], pos, cache)
        held += 1
        out.append(np.asarray(logits[:, 0]))
    return np.stack(out, 1), backend, cache, held


def two_turns(model, root, backend, prompts, plan, evict: bool, max_len: int = 256, steps: int = 6):
    """Turn 1, then (evict: save, close, restore) turn 2. -> [(tokens, logits)] per turn."""
    engine = HCacheEngine(model, str(root), plan=plan, max_len=max_len, prefill_chunk=32, chunk_tokens=16,
                          prefix_reuse=False, backend=backend)
    session = engine.new_session()
    out = [session.generate(prompts[0], steps, return_logits=True)]
    if evict:
        session_id = session.save()
        session.close()
        session = engine.restore(session_id)
    out.append(session.generate(prompts[1], steps, return_logits=True))
    session.close()
    return out, session


def short_smollm2(num_layers: int = 2):
    """SmolLM2 cut to `num_layers` layers of random weights (seed 0): its config otherwise (3 KV
    heads, vocabulary, context of 8192), tokenizer, chat format and stop tokens, as a
    `jhybrid.loading.pretrained.Pretrained`. For CLI tests of what runs around the model (modes,
    signals, limits, --tp) whose cost would otherwise be compiling 30 hybrid layers; the real model
    through the CLI: tests/test_generation_cli.py::test_generate_streams_text_and_speeds. Raises
    FileNotFoundError where the GGUF is not installed."""
    import dataclasses
    from unittest import mock

    from jhybrid.loading import pretrained
    from jhybrid.loading.gguf_loader import gguf_config, open_gguf
    from jhybrid.models import create_model

    path = pretrained.smollm2_gguf_path()
    reader = open_gguf(path)
    config = gguf_config(reader, path).replace(num_layers=num_layers)
    # load_pretrained reads the same file's metadata: hand it this reader rather than parse the
    # GGUF's 49k-token vocabulary a second time (~7 s on 2 cores)
    with mock.patch.object(pretrained, "open_gguf", lambda p: reader if p == path else open_gguf(p)):
        loaded = pretrained.load_pretrained(path, weights=False)
    return dataclasses.replace(loaded, model=create_model(config, seed=0))
