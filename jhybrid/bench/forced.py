"""Teacher-forced scoring through any attention backend (full or a hybrid mode).

The text goes in as a prefill of `context` tokens (chunks of `chunk` tokens, the last one padded
with position -1), then one token per decode step, exactly as generation would run it. Only the
decode steps are scored: they are the steps where the hybrid modes differ from full attention
(prefill is exact in every mode). The backend is opened for the text and `backend.before_step` is called before each step, as
the `Generator` does.
"""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np

from jhybrid.generation import make_step

log = logging.getLogger(__name__)


def _token_log_prob(logits, target: int) -> float:
    """log p(target) from logits [V] float32."""
    return float(jax.nn.log_softmax(logits)[target])


def forced_nll(model, backend, tokens: np.ndarray, context: int, chunk: int = 256,
               on_step=None, observe=None) -> np.ndarray:
    """Negative log-likelihoods (nats) of tokens[context + 1:], each predicted by a decode step.

    tokens: [N] int32 token ids, N > context + 1. Returns float64 [N - context - 1].
    on_step(done, total) is called after each prefill chunk (done 0) and each decode step (for
    progress bars, and the bench's interrupt check); observe(cache)
    after each decode step with the new cache (statistics of the backend's state).
    """
    tokens = np.asarray(tokens, np.int32)
    n = len(tokens)
    if not 0 < context < n - 1:
        raise ValueError(f"context={context} must be in (0, {n - 1}) for {n} tokens")
    chunk = min(chunk, backend.max_prefill_chunk or chunk)
    step, params = make_step(model, backend)
    backend.open(model.config, 1, n)
    cache = model.init_cache(1, n, backend)

    for begin in range(0, context, chunk):
        part = tokens[begin:min(begin + chunk, context)]
        pad = chunk - len(part)
        ids = np.pad(part, (0, pad))[None]
        pos = np.pad(np.arange(begin, begin + len(part), dtype=np.int32), (0, pad),
                     constant_values=-1)[None]
        cache = backend.before_step(cache, pos)
        _, cache = step(params, jnp.asarray(ids), jnp.asarray(pos), cache)
        if on_step is not None:  # also where a Ctrl-C is honoured: a long prefill is many chunks
            on_step(0, n - context - 1)

    nll = np.empty(n - context - 1)
    for i, position in enumerate(range(context, n - 1)):
        pos = np.full((1, 1), position, np.int32)
        cache = backend.before_step(cache, pos)
        logits, cache = step(params, jnp.asarray(tokens[None, position:position + 1]),
                             jnp.asarray(pos), cache)
        nll[i] = -_token_log_prob(logits[0, 0], int(tokens[position + 1]))
        if observe is not None:
            observe(cache)
        if on_step is not None:
            on_step(i + 1, len(nll))
    return nll
