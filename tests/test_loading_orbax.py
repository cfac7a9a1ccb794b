"""Orbax fast-reload folders: a converted model reloads to identical parameters and logits."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from tokenizers import Tokenizer, models

from jhybrid.generation import make_step
from jhybrid.loading.pretrained import Pretrained, load_pretrained
from jhybrid.models import ModelConfig, create_model


def test_save_and_reload_round_trip(tmp_path, rng):
    config = ModelConfig(family="gpt_neox", vocab_size=40, d_model=16, num_layers=2, num_heads=2,
                         num_kv_heads=2, head_dim=8, mlp_dim=32, max_position_embeddings=32,
                         norm_type="layer", mlp_type="gelu", rotary_dim=4, qkv_bias=True,
                         o_bias=True, mlp_bias=True, parallel_residual=True, eos_token_ids=(3,))
    model = create_model(config, seed=4)
    tokenizer = Tokenizer(models.WordLevel({"a": 0, "b": 1, "<unk>": 2}, unk_token="<unk>"))
    Pretrained(model, tokenizer, "memory", "chatml", "be brief", (3, 7)).save(str(tmp_path / "ckpt"))

    reloaded = load_pretrained(str(tmp_path / "ckpt"))
    assert reloaded.model.config == config
    assert reloaded.chat_format == "chatml" and reloaded.default_system == "be brief"
    assert reloaded.stop_token_ids == (3, 7)
    assert reloaded.tokenizer.token_to_id("b") == 1
    tokens = jnp.asarray(rng.integers(0, 40, (1, 10)), jnp.int32)
    positions = jnp.arange(10, dtype=jnp.int32)[None]
    outputs = []
    for m in (model, reloaded.model):
        step, params = make_step(m)
        outputs.append(np.asarray(step(params, tokens, positions, m.init_cache(1, 16))[0]))
    np.testing.assert_array_equal(outputs[0], outputs[1])
