"""scout's layer-ahead query: predicted-vs-real cosine on a tiny random model."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jhybrid.bench.query_similarity import query_similarity, summary
from jhybrid.models import ModelConfig, create_model


def tiny(layers=3):
    return create_model(ModelConfig(family="llama", vocab_size=64, d_model=64, num_layers=layers, num_heads=4,
                                    num_kv_heads=2, head_dim=16, mlp_dim=64, max_position_embeddings=256), seed=0)


def test_rows_per_predicted_layer_and_range():
    model = tiny(3)
    rows = query_similarity(model, np.arange(40) % 64, skip_first=1)
    assert [r["layer"] for r in rows] == [1, 2] and all(r["tokens"] == 39 for r in rows)
    for r in rows:
        assert -1.0 <= r["cos_p10"] <= r["cos_median"] <= 1.0 and -1.0 <= r["cos_mean"] <= 1.0
        assert r["rel_update_mean"] > 0
    assert summary(rows)["layers"] == 2


def test_a_layer_that_adds_nothing_makes_the_prediction_exact():
    model = tiny(2)
    layer = model.layers[0]
    for linear in (layer.attention.o_proj, layer.mlp.down_proj):  # layer 0's output = its input
        linear.kernel[...] = jnp.zeros(linear.kernel.shape, linear.kernel.dtype)
    row = query_similarity(model, np.arange(24) % 64)[0]
    assert row["cos_mean"] > 0.9999 and row["rel_update_mean"] < 1e-6
