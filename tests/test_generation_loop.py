"""The generation loop and the step API on a tiny random model: stop tokens, max tokens,
streaming, seeds, context errors, hidden-state capture, kv_from_hidden, backend hooks."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.attention import FullAttention
from jhybrid.generation import Generator, SamplingParams, make_step
from jhybrid.models import ModelConfig, create_model, kv_from_hidden

CONFIG = ModelConfig(family="llama", vocab_size=61, d_model=32, num_layers=3, num_heads=4,
                     num_kv_heads=2, head_dim=8, mlp_dim=48, max_position_embeddings=64,
                     qkv_bias=True, tie_embeddings=True)


@pytest.fixture(scope="module")
def model():
    return create_model(CONFIG, seed=1)


@pytest.fixture(scope="module")
def generator(model):
    return Generator(model, prefill_chunk=8)


def test_max_tokens_stop_tokens_and_streaming(generator, rng):
    prompts = [rng.integers(0, 61, 5).tolist(), rng.integers(0, 61, 12).tolist()]
    free = generator.generate(prompts, max_new_tokens=12)
    assert [len(t) for t in free.tokens] == [12, 12] and free.finish_reasons == ["length"] * 2
    # A stop token whose first occurrence is not at the start, so row 0 still decodes some tokens.
    late = [t for i, t in enumerate(free.tokens[0]) if i >= 2 and t not in free.tokens[0][:i]]
    stop = late[0] if late else free.tokens[0][3]
    streamed = [[], []]

    def on_tokens(tokens, emitted):
        for b in np.flatnonzero(emitted):
            streamed[b].append(int(tokens[b]))

    stopped = generator.generate(prompts, max_new_tokens=12, stop_tokens=[stop], on_tokens=on_tokens)
    first = free.tokens[0].index(stop)
    assert stopped.tokens[0] == free.tokens[0][:first]
    assert stopped.finish_reasons[0] == "stop"
    expected_1 = free.tokens[1][:free.tokens[1].index(stop)] if stop in free.tokens[1] else free.tokens[1]
    assert stopped.tokens[1] == expected_1
    assert streamed == stopped.tokens
    assert stopped.prefill_tokens_per_second > 0
    produced_after_first = sum(max(len(t) - 1, 0) for t in stopped.tokens)
    assert (stopped.decode_tokens_per_second > 0) == (produced_after_first > 0)


def test_seeded_sampling_is_reproducible(generator, rng):
    prompt = [rng.integers(0, 61, 7).tolist()]
    params = SamplingParams(temperature=1.0, top_k=10, seed=11)
    a = generator.generate(prompt, max_new_tokens=10, sampling=params).tokens
    b = generator.generate(prompt, max_new_tokens=10, sampling=params).tokens
    c = generator.generate(prompt, max_new_tokens=10,
                           sampling=dataclasses.replace(params, seed=12)).tokens
    assert a == b and a != c


def test_prompt_longer_than_context(generator):
    with pytest.raises(ValueError, match="longer than the model's context of 64"):
        generator.generate([[1] * 65], max_new_tokens=1)
    with pytest.raises(ValueError, match="at least one token"):
        generator.generate([[1, 2], []], max_new_tokens=1)


def test_generation_stops_at_full_cache(model):
    result = Generator(model, max_len=20).generate([[1] * 15], max_new_tokens=30)
    assert result.finish_reasons == ["context"] and len(result.tokens[0]) == 6


def test_hidden_state_capture_and_kv_from_hidden(model, rng):
    tokens = jnp.asarray(rng.integers(0, 61, (2, 9)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(9, dtype=jnp.int32), (2, 9))
    logits, cache, hidden = model(tokens, positions, model.init_cache(2, 16),
                                  return_hidden_states=True)
    assert hidden.shape == (CONFIG.num_layers, 2, 9, CONFIG.d_model)
    assert logits.shape == (2, 9, CONFIG.vocab_size)
    for i, layer in enumerate(model.layers):
        k, v = kv_from_hidden(layer, hidden[i], positions)
        assert k.shape == (2, 9, CONFIG.num_kv_heads, CONFIG.head_dim)
        np.testing.assert_allclose(np.asarray(cache.layers[i]["k"][:, :9]), np.asarray(k), atol=1e-6)
        np.testing.assert_allclose(np.asarray(cache.layers[i]["v"][:, :9]), np.asarray(v), atol=1e-6)


class RecordingBackend(FullAttention):
    """A backend that records what the interface hands it: the layer index, the next layer's
    predicted query (asked for layers 0 and 1) and the carry the previous layer handed on."""

    def __init__(self):
        self.calls = []

    def query_ahead(self, layer_idx, config):
        return layer_idx + 1 if layer_idx in (0, 1) else None

    def attend(self, layer_idx, q, k, v, positions, lengths, layer_cache, context):
        nq = None if context.next_query is None else context.next_query.shape
        self.calls.append((layer_idx, context.carry, nq, q.shape, context.num_layers, k.shape))
        out, layer_cache, _ = super().attend(layer_idx, q, k, v, positions, lengths, layer_cache, context)
        return out, layer_cache, f"from layer {layer_idx}"


def test_backend_receives_layer_index_next_query_and_carry(model):
    backend = RecordingBackend()
    tokens = jnp.zeros((1, 4), jnp.int32)
    positions = jnp.arange(4, dtype=jnp.int32)[None]
    model(tokens, positions, model.init_cache(1, 8, backend), backend)
    assert [c[0] for c in backend.calls] == [0, 1, 2]
    assert [c[1] for c in backend.calls] == [None, "from layer 0", "from layer 1"]
    q_shape = backend.calls[0][3]
    assert [c[2] for c in backend.calls] == [q_shape, q_shape, None]  # asked for 0 and 1; 2 is last
    assert all(c[4] == CONFIG.num_layers for c in backend.calls)
    assert backend.calls[0][3] == (1, 4, 4, 8) and backend.calls[0][5] == (1, 4, 2, 8)
    # the next layer's query projection is usable as a prediction hook (ScoutAttention)
    predicted = model.layers[1].attention.project_q(
        model.layers[1].attention_input(jnp.ones((1, 4, CONFIG.d_model))), positions)
    assert predicted.shape == (1, 4, 4, 8)


def test_step_api_with_padding_slots(model, rng):
    step, params = make_step(model)
    cache = model.init_cache(2, 16)
    tokens = jnp.asarray(rng.integers(0, 61, (2, 6)), jnp.int32)
    positions = jnp.asarray([[0, 1, 2, 3, 4, 5], [0, 1, -1, -1, -1, -1]], jnp.int32)
    logits, cache = step(params, tokens, positions, cache)
    assert list(np.asarray(cache.lengths)) == [6, 2]
    alone, _ = step(params, tokens[1:, :2], positions[1:, :2], model.init_cache(1, 16))
    np.testing.assert_allclose(np.asarray(logits[1, :2]), np.asarray(alone[0]), atol=1e-5)
