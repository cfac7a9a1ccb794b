"""GGUF loading: a tiny F32 GGUF written with llama.cpp's Q/K permutation must give the same
model as the safetensors folder of the same weights; bad files fail with the path named."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jhybrid.generation import make_step
from jhybrid.loading.gguf_loader import load_gguf_model, permute_rope_rows, unpermute_rope_rows
from jhybrid.loading.hf import load_hf_model
from jhybrid.loading.pretrained import load_pretrained
from tests.hf_reference import VOCAB, hf_logits, make_hf_model, save_hf_model


def write_llama_gguf(hf_model, path: str) -> None:
    """Writes an HF Llama model the way llama.cpp's convert_hf_to_gguf.py does (F32 tensors)."""
    import gguf

    cfg = hf_model.config
    state = {k: v.detach().numpy().astype(np.float32) for k, v in hf_model.state_dict().items()}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    if "lm_head.weight" in state and not cfg.tie_word_embeddings:
        writer.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        writer.add_tensor(f"blk.{i}.attn_norm.weight", state[p + "input_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", state[p + "post_attention_layernorm.weight"])
        writer.add_tensor(f"blk.{i}.attn_q.weight", permute_rope_rows(
            state[p + "self_attn.q_proj.weight"], cfg.num_attention_heads))
        writer.add_tensor(f"blk.{i}.attn_k.weight", permute_rope_rows(
            state[p + "self_attn.k_proj.weight"], cfg.num_key_value_heads))
        writer.add_tensor(f"blk.{i}.attn_v.weight", state[p + "self_attn.v_proj.weight"])
        writer.add_tensor(f"blk.{i}.attn_output.weight", state[p + "self_attn.o_proj.weight"])
        for ours, theirs in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"),
                             ("ffn_down", "down_proj")):
            writer.add_tensor(f"blk.{i}.{ours}.weight", state[p + f"mlp.{theirs}.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def llama_files(tmp_path_factory):
    pytest.importorskip("gguf")
    hf = make_hf_model("llama")
    folder = tmp_path_factory.mktemp("llama_hf")
    save_hf_model(hf, folder)
    gguf_path = str(folder / "tiny.gguf")
    write_llama_gguf(hf, gguf_path)
    return hf, str(folder), gguf_path


def test_permutation_round_trip(rng):
    w = rng.standard_normal((3 * 8, 5))
    assert not np.array_equal(permute_rope_rows(w, 3), w)
    np.testing.assert_array_equal(unpermute_rope_rows(permute_rope_rows(w, 3), 3), w)


def test_gguf_and_safetensors_give_the_same_model(llama_files, rng):
    hf, folder, gguf_path = llama_files
    from_gguf, from_hf = load_gguf_model(gguf_path), load_hf_model(folder)
    assert from_gguf.config.num_kv_heads == from_hf.config.num_kv_heads == 2
    q_gguf = from_gguf.layers[1].attention.q_proj.kernel.get_value()
    q_hf = from_hf.layers[1].attention.q_proj.kernel.get_value()
    np.testing.assert_array_equal(np.asarray(q_gguf), np.asarray(q_hf))
    tokens = rng.integers(0, VOCAB, (1, 16))
    positions = jnp.arange(16, dtype=jnp.int32)[None]
    outputs = []
    for model in (from_gguf, from_hf):
        step, params = make_step(model)
        logits, _ = step(params, jnp.asarray(tokens, jnp.int32), positions, model.init_cache(1, 16))
        outputs.append(np.asarray(logits))
    np.testing.assert_allclose(outputs[0], outputs[1], atol=1e-6)
    np.testing.assert_allclose(outputs[0], hf_logits(hf, tokens), atol=2e-5, rtol=1e-4)


def test_truncated_gguf_names_the_path(llama_files, tmp_path):
    _, _, gguf_path = llama_files
    data = open(gguf_path, "rb").read()
    broken = tmp_path / "truncated.gguf"
    broken.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="truncated.gguf"):
        load_pretrained(str(broken))


def test_missing_model_path():
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_pretrained("/tmp/no-such-model")
