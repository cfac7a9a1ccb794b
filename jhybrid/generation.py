"""Text generation: chunked prefill, jitted decode steps, sampling, and a step API.

Two levels:
  * `make_step(model)` -> (step, params) with `logits, cache = step(params, tokens, positions,
    cache)`: one jitted forward over any tokens (cache donated), for users' own loops.
  * `Generator(model).generate(prompts, ...)`: a batch of prompts of different lengths, exact
    chunked prefill, one jitted decode+sample step per token, stop tokens, max tokens, a
    streaming callback, timings.

Batches are ragged by positions (see jhybrid.attention.base): each prompt occupies positions
0..len-1 of its own row; slots past a prompt's end, and finished rows, carry position -1.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jhybrid.attention.base import AttentionBackend
from jhybrid.attention.full import FullAttention
from jhybrid.models.decoder import CausalLM, KVCache


# ----------------------------------------------------------------------------- sampling


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """temperature 0 means greedy; top_k 0 and top_p 1.0 disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        bad = []
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            bad.append(f"temperature={self.temperature!r} (must be a finite number >= 0)")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            bad.append(f"top_k={self.top_k!r} (must be an integer >= 0)")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            bad.append(f"top_p={self.top_p!r} (must be in (0, 1])")
        if not isinstance(self.seed, int):
            bad.append(f"seed={self.seed!r} (must be an integer)")
        if bad:
            raise ValueError("invalid sampling parameters: " + "; ".join(bad))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sample_tokens(logits: jax.Array, key: jax.Array, params: SamplingParams) -> jax.Array:
    """logits [B, V] float32 -> next tokens [B] int32 (greedy, or temperature/top-k/top-p)."""
    if params.greedy:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth_largest = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
        logits = jnp.where(logits < kth_largest, -jnp.inf, logits)
    if params.top_p < 1.0:
        # Keep the smallest set of most likely tokens whose probability mass reaches top_p.
        sorted_logits = jnp.sort(logits, axis=-1)[..., ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        mass_before = jnp.cumsum(probs, axis=-1) - probs
        num_kept = jnp.sum(mass_before < params.top_p, axis=-1, keepdims=True)
        threshold = jnp.take_along_axis(sorted_logits, num_kept - 1, axis=-1)
        logits = jnp.where(logits < threshold, -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


# ----------------------------------------------------------------------------- step API


def make_step(model: CausalLM, backend: AttentionBackend | None = None):
    """Returns (step, params) for a user's own loop.

    `logits, cache = step(params, tokens, positions, cache)` with tokens/positions [B, T] int32
    (position -1 = padding), cache from `model.init_cache(B, max_len, backend)` (donated: do not
    reuse the old one), logits [B, T, vocab] float32. With an offloading backend, open its host side
    first (`backend.open(model.config, B, max_len)`) and call `cache = backend.before_step(cache,
    positions)` before each step (jhybrid.attention.base shows the whole loop).
    """
    backend = backend or FullAttention()
    graphdef, params = nnx.split(model)

    def step(params, tokens, positions, cache):
        return nnx.merge(graphdef, params)(tokens, positions, cache, backend)

    return jax.jit(step, donate_argnums=(3,)), params


# ----------------------------------------------------------------------------- generator


@dataclasses.dataclass
class GenerationResult:
    """tokens: generated ids per prompt (stop token excluded); finish_reasons: "stop", "length"
    (max_new_tokens) or "context" (cache full). Times in seconds, compilation excluded."""

    tokens: list[list[int]]
    finish_reasons: list[str]
    prompt_tokens: int
    prefill_seconds: float
    decode_seconds: float
    decode_steps: int
    compile_seconds: float

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / max(self.prefill_seconds, 1e-9)

    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens per second over all sequences, after the first token."""
        produced = sum(max(len(t) - 1, 0) for t in self.tokens)  # a row that stopped at once adds 0
        return produced / max(self.decode_seconds, 1e-9)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class Generator:
    """Generates from a batch of token prompts with one model and one attention backend.

    prefill_chunk: tokens per prefill step (the chunked prefill is exact).
    max_len: cache capacity in tokens per sequence (default: prompt + max_new_tokens, rounded up
    to 64, capped by the model's context).
    parallel: a `jhybrid.parallel.TensorParallel` of `model`: its placed parameters, its backend
    (one host side per device) and its sharded cache are used instead (`backend` must be None).
    """

    def __init__(self, model: CausalLM, backend: AttentionBackend | None = None,
                 prefill_chunk: int = 256, max_len: int | None = None, parallel=None):
        if prefill_chunk <= 0:
            raise ValueError(f"prefill_chunk={prefill_chunk} must be > 0")
        if parallel is not None and backend is not None:
            raise ValueError("Generator(parallel=...) runs the tensor-parallel backend; pass no backend")
        self.config = model.config
        self.parallel = parallel
        self.backend = parallel.backend if parallel is not None else (backend or FullAttention())
        # An offloading backend may bound the chunk (its GPU ring must hold one chunk).
        self.prefill_chunk = min(prefill_chunk, self.backend.max_prefill_chunk or prefill_chunk)
        self.max_len = max_len
        if parallel is not None:  # the parameters as the tensor-parallel layout placed them
            self.graphdef, self.params = parallel.graphdef, parallel.params
        else:
            self.graphdef, self.params = nnx.split(model)
        self._executables: dict = {}
        self.compile_seconds = 0.0

    # -- jitted pieces (pure functions of params and cache) --

    def _prefill_fn(self, params, tokens, positions, cache):
        """One prefill chunk -> (logits at each row's last valid token [B, V], row had one [B], cache)."""
        model = nnx.merge(self.graphdef, params)
        hidden, cache, _ = model.hidden_states(tokens, positions, cache, self.backend)
        last = jnp.argmax(positions, axis=1)
        last_hidden = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        return model.logits(last_hidden), jnp.any(positions >= 0, axis=1), cache

    def _decode_fn(self, sampling, params, tokens, positions, cache, key, step_index):
        """One token per row: forward + sample -> (next tokens [B], cache)."""
        model = nnx.merge(self.graphdef, params)
        logits, cache = model(tokens[:, None], positions[:, None], cache, self.backend)
        return sample_tokens(logits[:, 0], jax.random.fold_in(key, step_index), sampling), cache

    def _sample_fn(self, sampling, logits, key):
        return sample_tokens(logits, jax.random.fold_in(key, 0), sampling)

    def _run(self, name: str, fn, donate: tuple, *args):
        """Calls fn compiled ahead of time for these shapes (compile time kept apart)."""
        # self.params never changes shape: skip flattening its hundreds of leaves every step.
        varying = [a for a in args if a is not self.params]
        leaves, treedef = jax.tree_util.tree_flatten(varying)  # the structure too: a hybrid cache
        # (a tuple of a list, not of a generator: CPython parks each generator-built tuple's resized
        # copy in its free list, a creep of a few hundred KiB over thousands of steps)
        key = (name, treedef) + tuple([(a.shape, str(a.dtype)) for a in leaves])  # gains prefill copies
        if key not in self._executables:
            start = time.perf_counter()
            self._executables[key] = jax.jit(fn, donate_argnums=donate).lower(*args).compile()
            self.compile_seconds += time.perf_counter() - start
        return self._executables[key](*args)

    # -- the loop --

    def _check_prompts(self, prompts, max_new_tokens) -> int:
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
        vocab = self.config.vocab_size
        for row, prompt in enumerate(prompts):
            ids = np.asarray(prompt)
            if not np.issubdtype(ids.dtype, np.integer):
                raise ValueError(f"prompt {row} has {ids.dtype} entries; expected integer token ids")
            bad = (ids < 0) | (ids >= vocab)
            if bad.any():
                at = int(np.argmax(bad))
                raise ValueError(f"prompt {row} token {at} is id {int(ids[at])}; expected ids in "
                                 f"[0, {vocab}) (the model's vocabulary)")
        longest = max(len(p) for p in prompts)
        context = self.config.max_position_embeddings
        if self.backend.handles_long_context:
            capacity = self.max_len or longest + max_new_tokens
        else:
            capacity = min(self.max_len or context, context)
            if longest > capacity:
                raise ValueError(
                    f"prompt of {longest} tokens is longer than the model's context of {capacity} "
                    f"tokens (backend {self.backend.name!r} keeps all KV on the device; an "
                    "offloading backend would be needed)")
        return self.max_len or min(capacity, _round_up(longest + max_new_tokens, 64))

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        sampling: SamplingParams = SamplingParams(),
        stop_tokens: Sequence[int] = (),
        on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None,
    ) -> GenerationResult:
        """Generates up to max_new_tokens for each prompt.

        on_tokens(tokens [B] int, emitted [B] bool) is called once per step with the new token of
        every row; rows with emitted False produced nothing this step (finished earlier or stopped).
        """
        max_len = self._check_prompts(prompts, max_new_tokens)
        batch, lengths = len(prompts), np.array([len(p) for p in prompts])
        stop = set(int(t) for t in stop_tokens)
        cache = self._init_cache(batch, max_len)
        overlaps = self.backend.overlap_dispatch()  # host work in each call's shadow (scout's recalls)
        key = jax.random.key(sampling.seed)
        compile_before = self.compile_seconds

        # Prefill in chunks: chunk c holds prompt tokens [c*C, (c+1)*C) of every row.
        chunk = min(self.prefill_chunk, _round_up(int(lengths.max()), 16))
        start = time.perf_counter()
        last_logits = None
        for begin in range(0, int(lengths.max()), chunk):
            pos = begin + np.arange(chunk)[None, :]
            valid = pos < lengths[:, None]
            tokens = np.zeros((batch, chunk), np.int32)
            for b, prompt in enumerate(prompts):
                part = prompt[begin:begin + chunk]
                tokens[b, :len(part)] = part
            positions = np.where(valid, pos, -1).astype(np.int32)
            cache = self._before_step(cache, positions)
            logits, has_token, cache = self._run("prefill", self._prefill_fn, (3,), self.params,
                                                 tokens, positions, cache)
            if overlaps:
                cache = self.backend.after_dispatch(cache)
            last_logits = logits if last_logits is None else jnp.where(has_token[:, None], logits,
                                                                       last_logits)
        static = dataclasses.replace(sampling, seed=0)  # the seed lives in `key`: no recompiles
        sample = functools.partial(self._sample_fn, static)
        next_tokens = np.asarray(self._run(f"sample{static}", sample, (), last_logits, key))
        prefill_seconds = time.perf_counter() - start - (self.compile_seconds - compile_before)

        generated: list[list[int]] = [[] for _ in range(batch)]
        reasons = [""] * batch
        held = lengths.copy()  # tokens in the cache per row
        decode = functools.partial(self._decode_fn, static)
        start, compile_before, steps = time.perf_counter(), self.compile_seconds, 0
        while True:
            emitted = np.zeros(batch, bool)
            for b in range(batch):
                if reasons[b]:
                    continue
                token = int(next_tokens[b])
                if token in stop:
                    reasons[b] = "stop"
                    continue
                generated[b].append(token)
                emitted[b] = True
                if len(generated[b]) >= max_new_tokens:
                    reasons[b] = "length"
                elif held[b] >= max_len:
                    reasons[b] = "context"
            if on_tokens is not None and emitted.any():
                on_tokens(next_tokens.copy(), emitted)
            active = np.array([not r for r in reasons])
            if not active.any():
                break
            positions = np.where(active, held, -1).astype(np.int32)
            cache = self._before_step(cache, positions[:, None])
            next_tokens, cache = self._run(f"decode{static}", decode, (3,), self.params,
                                           next_tokens.astype(np.int32), positions, cache, key,
                                           np.int32(steps + 1))
            if overlaps:
                cache = self.backend.after_dispatch(cache)
            next_tokens = np.asarray(next_tokens)
            held += active
            steps += 1
        decode_seconds = time.perf_counter() - start - (self.compile_seconds - compile_before)
        return GenerationResult(
            tokens=generated, finish_reasons=reasons, prompt_tokens=int(lengths.sum()),
            prefill_seconds=prefill_seconds, decode_seconds=decode_seconds, decode_steps=steps,
            compile_seconds=self.compile_seconds)

    def _before_step(self, cache: KVCache, positions: np.ndarray) -> KVCache:
        """The backend's per-step host work (eviction, recall; nothing for full)."""
        return self.backend.before_step(cache, positions)

    def _init_cache(self, batch: int, max_len: int) -> KVCache:
        """Opens the backend's host side for this batch (left open for its counters afterwards;
        the next generate or backend.close() ends it) and builds the device cache."""
        self.backend.open(self.config, batch, max_len)
        if self.parallel is not None:
            return self.parallel.init_cache(batch, max_len)
        model = nnx.merge(self.graphdef, self.params)
        return model.init_cache(batch, max_len, self.backend)

    # -- the backend's host side --

    def close(self) -> None:
        """Closes the backend's host side (host store, worker threads, native exchange).

        Ownership: a Generator owns its backend's host side, whoever built the backend object:
        every `generate` opens it for its batch (closing what was open before), and leaves it open
        afterwards so that `backend.counters()` can still be read; `close()` (or leaving a `with
        Generator(...)` block, also by an exception or Ctrl-C) closes it. The backend object stays
        usable: a later `generate` opens it again. Closing twice, or a backend never opened, is
        a no-op."""
        self.backend.close()

    def __enter__(self) -> "Generator":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
