"""Reference models for the parity tests: tiny randomly initialised Hugging Face models of every
supported family (imported by the test modules; not a test module)."""

from __future__ import annotations

import os

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
import torch  # noqa: E402
import transformers  # noqa: E402

VOCAB = 97

TINY_CONFIGS = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        rope_theta=500.0, tie_word_embeddings=False),
    "llama3_rope_scaling": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=256,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        rope_theta=10000.0, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        sliding_window=None),
    "mistral_sliding_window": lambda: transformers.MistralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        sliding_window=7),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=True),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, max_position_embeddings=128,
        sliding_window=6, query_pre_attn_scalar=12, final_logit_softcapping=3.0,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "opt": lambda: transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=32, ffn_dim=48, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=128, word_embed_proj_dim=32, pad_token_id=1),
    "gpt_neox": lambda: transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, rotary_pct=0.5,
        use_parallel_residual=True),
    "gpt_neox_sequential": lambda: transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=128, rotary_pct=0.25,
        use_parallel_residual=False),
}


# Query / key projections are scaled up so that attention is sharp (scores spanning several units):
# with HF's 0.02 init the tiny models attend almost uniformly, and dropping RoPE moved the logits by
# only ~1e-3 (tests/test_models_hf_parity.py keeps that control).
SHARP = 6.0


def make_hf_model(family: str, seed: int = 0):
    """A float32, eager-attention HF causal LM with random weights (biases and norms randomised
    too, so a wrong mapping cannot hide behind zeros and ones; Q/K projections scaled by SHARP)."""
    torch.manual_seed(seed)
    config = TINY_CONFIGS[family]()
    config._attn_implementation = "eager"
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                param.add_(0.1 * torch.randn_like(param))
            if any(key in name for key in ("q_proj.weight", "k_proj.weight", "query_key_value.weight")):
                param.mul_(SHARP)
    return model.float().eval()


def save_hf_model(model, folder) -> str:
    model.save_pretrained(str(folder), safe_serialization=True)
    return str(folder)


def hf_logits(model, tokens) -> "numpy.ndarray":
    with torch.no_grad():
        return model(torch.as_tensor(tokens)).logits.float().numpy()
