"""Parity of our NNX models (loaded from safetensors) with Hugging Face transformers (torch CPU)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jhybrid.generation import Generator, make_step
from jhybrid.loading.hf import load_hf_model
from tests.hf_reference import TINY_CONFIGS, VOCAB, hf_logits, make_hf_model, save_hf_model

FAMILIES = list(TINY_CONFIGS)
ATOL = 2e-5


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request, tmp_path_factory):
    """(family, HF torch model, our model loaded from its save_pretrained folder)."""
    hf = make_hf_model(request.param)
    folder = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return request.param, hf, load_hf_model(folder)


def _positions(batch, length, start=0):
    return jnp.broadcast_to(jnp.arange(start, start + length, dtype=jnp.int32), (batch, length))


def test_prefill_logits_match(pair, rng):
    family, hf, ours = pair
    tokens = rng.integers(0, VOCAB, (2, 19))
    expected = hf_logits(hf, tokens)
    step, params = make_step(ours)
    logits, cache = step(params, jnp.asarray(tokens, jnp.int32), _positions(2, 19),
                         ours.init_cache(2, 32))
    np.testing.assert_allclose(np.asarray(logits), expected, atol=ATOL, rtol=1e-4)
    assert list(np.asarray(cache.lengths)) == [19, 19]


def test_control_dropping_rope_is_far_outside_the_tolerance(pair, rng, monkeypatch):
    """The parity tolerance can see a wrong model: without RoPE (rotary families) the logits move by
    far more than ATOL."""
    family, hf, ours = pair
    if ours.config.position_type != "rope":
        pytest.skip(f"{family} has no rotary positions")
    import jhybrid.models.layers as layers

    tokens = rng.integers(0, VOCAB, (2, 19))
    expected = hf_logits(hf, tokens)
    monkeypatch.setattr(layers, "apply_rope", lambda x, positions, config, local=False: x)
    step, params = make_step(ours)
    logits, _ = step(params, jnp.asarray(tokens, jnp.int32), _positions(2, 19), ours.init_cache(2, 32))
    assert np.max(np.abs(np.asarray(logits) - expected)) > 100 * ATOL


def test_step_by_step_decode_logits_match(pair, rng):
    family, hf, ours = pair
    tokens = rng.integers(0, VOCAB, (1, 24))
    expected = hf_logits(hf, tokens)
    step, params = make_step(ours)
    cache = ours.init_cache(1, 32)
    logits, cache = step(params, jnp.asarray(tokens[:, :8], jnp.int32), _positions(1, 8), cache)
    np.testing.assert_allclose(np.asarray(logits), expected[:, :8], atol=ATOL, rtol=1e-4)
    for t in range(8, 24):
        logits, cache = step(params, jnp.asarray(tokens[:, t:t + 1], jnp.int32),
                             _positions(1, 1, t), cache)
        np.testing.assert_allclose(np.asarray(logits[:, 0]), expected[:, t], atol=ATOL, rtol=1e-4,
                                   err_msg=f"{family} decode step at position {t}")


def test_greedy_32_tokens_identical(pair, rng):
    family, hf, ours = pair
    prompt = rng.integers(2, VOCAB, 11).tolist()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=32, min_new_tokens=32,
                          do_sample=False, pad_token_id=0, eos_token_id=None)
    expected = out[0, len(prompt):].tolist()
    result = Generator(ours, prefill_chunk=4).generate([prompt], max_new_tokens=32)
    assert result.tokens[0] == expected
    assert result.finish_reasons == ["length"]


def test_chunked_prefill_equals_one_shot(pair, rng):
    family, hf, ours = pair
    tokens = jnp.asarray(rng.integers(0, VOCAB, (2, 21)), jnp.int32)
    step, params = make_step(ours)
    one_shot, _ = step(params, tokens, _positions(2, 21), ours.init_cache(2, 32))
    cache, chunks = ours.init_cache(2, 32), []
    for begin in range(0, 21, 5):  # chunks of 5 with a ragged last chunk of 1
        end = min(begin + 5, 21)
        logits, cache = step(params, tokens[:, begin:end], _positions(2, end - begin, begin), cache)
        chunks.append(logits)
    np.testing.assert_allclose(np.asarray(jnp.concatenate(chunks, axis=1)), np.asarray(one_shot),
                               atol=1e-5, rtol=1e-5)


def test_ragged_batch_equals_per_sequence_runs(pair, rng):
    family, hf, ours = pair
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in (3, 17, 9)]
    generator = Generator(ours, prefill_chunk=8)
    batched = generator.generate(prompts, max_new_tokens=10)
    for prompt, tokens in zip(prompts, batched.tokens):
        assert generator.generate([prompt], max_new_tokens=10).tokens[0] == tokens
    # and the logits: a right-padded prefill row equals the row run alone
    step, params = make_step(ours)
    padded = np.zeros((3, 17), np.int32)
    positions = np.full((3, 17), -1, np.int32)
    for b, prompt in enumerate(prompts):
        padded[b, :len(prompt)] = prompt
        positions[b, :len(prompt)] = np.arange(len(prompt))
    logits, cache = step(params, jnp.asarray(padded), jnp.asarray(positions), ours.init_cache(3, 32))
    assert list(np.asarray(cache.lengths)) == [3, 17, 9]
    for b, prompt in enumerate(prompts):
        expected = hf_logits(hf, np.array([prompt]))[0]
        np.testing.assert_allclose(np.asarray(logits[b, :len(prompt)]), expected, atol=ATOL,
                                   rtol=1e-4)


def test_interleaved_rope_with_permuted_weights_is_the_same_model(rng, tmp_path):
    """rope_interleaved=True on llama.cpp-permuted Q/K rows == rotate-half on HF rows."""
    from flax import nnx

    from jhybrid.loading.gguf_loader import permute_rope_rows
    from jhybrid.models import CausalLM

    hf = make_hf_model("llama")
    ours = load_hf_model(save_hf_model(hf, tmp_path))
    interleaved = CausalLM(ours.config.replace(rope_interleaved=True), rngs=nnx.Rngs(0))
    nnx.update(interleaved, nnx.state(ours))
    for layer in interleaved.layers:
        for proj, heads in ((layer.attention.q_proj, ours.config.num_heads),
                            (layer.attention.k_proj, ours.config.num_kv_heads)):
            kernel = np.asarray(proj.kernel.get_value())  # [in, out]: permute the output rows
            proj.kernel.set_value(jnp.asarray(permute_rope_rows(kernel.T, heads).T))
    tokens = jnp.asarray(rng.integers(0, VOCAB, (1, 12)), jnp.int32)
    outputs = [np.asarray(m(tokens, _positions(1, 12), m.init_cache(1, 16))[0])
               for m in (ours, interleaved)]
    np.testing.assert_allclose(outputs[0], outputs[1], atol=1e-5)
