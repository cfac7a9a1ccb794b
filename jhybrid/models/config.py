"""One configuration dataclass for every supported decoder family.

The families differ only in a handful of switches (norm type, MLP type, residual layout, how
positions enter the model), so one frozen dataclass describes them all; `from_hf_config` maps a
Hugging Face `config.json` dict onto it and names the field that it cannot handle.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

# model_type in a Hugging Face config.json -> our family name.
HF_MODEL_TYPES = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "opt": "opt",
    "gpt_neox": "gpt_neox",
    "gemma3_text": "gemma3",
}
SUPPORTED_ARCHITECTURES = tuple(HF_MODEL_TYPES)


def unsupported_architecture(name: str) -> ValueError:
    return ValueError(
        f"unsupported architecture {name!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
        "(Hugging Face model_type) and GGUF general.architecture 'llama'"
    )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a decoder-only transformer.

    family: "llama" (Llama 2/3, Mistral, Qwen2, SmolLM2), "opt", "gpt_neox" or "gemma3".
    """

    family: str
    vocab_size: int
    d_model: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    mlp_dim: int
    max_position_embeddings: int
    norm_eps: float = 1e-5
    norm_type: str = "rms"  # "rms" | "layer"
    mlp_type: str = "swiglu"  # "swiglu"/"geglu" (gate/up/down, SiLU/tanh-GELU) | "relu"/"gelu" (fc1/fc2)
    # Position handling: "rope" (rotary on q/k) or "learned" (OPT: added to the embeddings).
    position_type: str = "rope"
    rope_theta: float = 10000.0
    rope_interleaved: bool = False  # False: rotate-half pairs (i, i+D/2) as in HF; True: (2i, 2i+1)
    rotary_dim: int | None = None  # partial rotary (GPT-NeoX); None means the whole head_dim
    rope_scaling: tuple[tuple[str, Any], ...] | None = None  # e.g. llama3 parameters, as sorted items
    learned_position_offset: int = 2  # OPT's position-embedding table starts at index 2
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    parallel_residual: bool = False  # GPT-NeoX: x + attn(ln1 x) + mlp(ln2 x)
    norm_before: bool = True  # pre-LN (False: OPT-350m-style post-LN)
    tie_embeddings: bool = False
    sliding_window: int | None = None
    # Per-layer attention kind ("sliding_attention" | "full_attention"); None: every layer is
    # sliding when sliding_window is set, else full. Gemma 3 mixes them.
    layer_types: tuple[str, ...] | None = None
    rope_local_theta: float | None = None  # RoPE theta of sliding layers (Gemma 3: 10k)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Gemma 3)
    sandwich_norm: bool = False  # extra norms on the attention and MLP outputs (Gemma 3)
    embed_scale: float | None = None  # token embeddings multiplied by this (Gemma: sqrt(d_model))
    query_pre_attn_scalar: float | None = None  # score scale = this ** -0.5 (default head_dim)
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    dtype: str = "float32"  # compute dtype of activations; parameters are stored as loaded
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.family not in ("llama", "opt", "gpt_neox", "gemma3"):
            raise unsupported_architecture(self.family)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )

    @property
    def rotary_dims(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def is_sliding_layer(self, layer_idx: int) -> bool:
        if self.sliding_window is None:
            return False
        if self.layer_types is None:
            return True
        return self.layer_types[layer_idx] == "sliding_attention"

    @property
    def global_layers(self) -> tuple[int, ...]:
        """Indices of the layers that attend the whole context (every layer but the sliding-window
        ones); the offloading modes offload only these."""
        return tuple(i for i in range(self.num_layers) if not self.is_sliding_layer(i))

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return None if self.rope_scaling is None else dict(self.rope_scaling)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> "ModelConfig":
        raw = json.loads(text)
        if raw.get("rope_scaling") is not None:
            raw["rope_scaling"] = tuple(tuple(kv) for kv in raw["rope_scaling"])
        raw["eos_token_ids"] = tuple(raw.get("eos_token_ids") or ())
        if raw.get("layer_types") is not None:
            raw["layer_types"] = tuple(raw["layer_types"])
        return cls(**raw)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)


def _rope_parameters(hf: dict) -> dict:
    """transformers >= 5 writes `rope_parameters`; older configs have rope_theta/rope_scaling."""
    params = dict(hf.get("rope_parameters") or {})
    if "rope_theta" not in params and "rope_theta" in hf:
        params["rope_theta"] = hf["rope_theta"]
    if hf.get("rope_scaling"):
        params.update(hf["rope_scaling"])
        params.setdefault("rope_type", params.get("type", "default"))
    if "rotary_pct" in hf and "partial_rotary_factor" not in params:
        params["partial_rotary_factor"] = hf["rotary_pct"]
    return params


def _eos_ids(hf: dict) -> tuple[int, ...]:
    eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def from_hf_config(hf: dict) -> ModelConfig:
    """Maps a Hugging Face config.json dict onto ModelConfig (ValueError on what we do not support)."""
    model_type = hf.get("model_type")
    if model_type not in HF_MODEL_TYPES:
        raise unsupported_architecture(str(model_type))
    family = HF_MODEL_TYPES[model_type]
    rope = _rope_parameters(hf)
    rope_type = rope.get("rope_type", "default")
    if rope_type not in ("default", "llama3"):
        raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported (default, llama3)")
    scaling = None
    if rope_type == "llama3":
        keys = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
        scaling = tuple(sorted([("rope_type", "llama3")] + [(k, rope[k]) for k in keys]))
    common = dict(
        vocab_size=hf["vocab_size"],
        d_model=hf["hidden_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        max_position_embeddings=hf["max_position_embeddings"],
        tie_embeddings=bool(hf.get("tie_word_embeddings", family == "opt")),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_ids=_eos_ids(hf),
    )
    if family == "llama":
        head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act={act!r} is not supported for {model_type} (silu)")
        window = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        return ModelConfig(
            family="llama",
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=head_dim,
            mlp_dim=hf["intermediate_size"],
            norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling,
            qkv_bias=bool(hf.get("attention_bias", model_type == "qwen2")),
            o_bias=bool(hf.get("attention_bias", False)),
            mlp_bias=bool(hf.get("mlp_bias", False)),
            sliding_window=window,
            **common,
        )
    if family == "gemma3":
        return _gemma3_config(hf, common)
    if family == "opt":
        if hf.get("word_embed_proj_dim", hf["hidden_size"]) != hf["hidden_size"]:
            raise ValueError("word_embed_proj_dim != hidden_size (OPT-350m projections) is not supported")
        act = hf.get("activation_function", "relu")
        if act != "relu":
            raise ValueError(f"activation_function={act!r} is not supported for opt (relu)")
        bias = bool(hf.get("enable_bias", True))
        return ModelConfig(
            family="opt",
            num_kv_heads=hf["num_attention_heads"],
            head_dim=hf["hidden_size"] // hf["num_attention_heads"],
            mlp_dim=hf["ffn_dim"],
            norm_eps=1e-5,
            norm_type="layer",
            mlp_type="relu",
            position_type="learned",
            qkv_bias=bias,
            o_bias=bias,
            mlp_bias=bias,
            norm_before=bool(hf.get("do_layer_norm_before", True)),
            **common,
        )
    # gpt_neox
    act = hf.get("hidden_act", "gelu")
    if act != "gelu":
        raise ValueError(f"hidden_act={act!r} is not supported for gpt_neox (gelu)")
    head_dim = hf["hidden_size"] // hf["num_attention_heads"]
    bias = bool(hf.get("attention_bias", True))
    return ModelConfig(
        family="gpt_neox",
        num_kv_heads=hf["num_attention_heads"],
        head_dim=head_dim,
        mlp_dim=hf["intermediate_size"],
        norm_eps=hf.get("layer_norm_eps", 1e-5),
        norm_type="layer",
        mlp_type="gelu",
        rope_theta=float(rope.get("rope_theta", 10000.0)),
        rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)),
        qkv_bias=bias,
        o_bias=bias,
        mlp_bias=True,
        parallel_residual=bool(hf.get("use_parallel_residual", True)),
        **common,
    )


def _gemma3_config(hf: dict, common: dict) -> ModelConfig:
    act = hf.get("hidden_activation", "gelu_pytorch_tanh")
    if act != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation={act!r} is not supported for gemma3 (gelu_pytorch_tanh)")
    if hf.get("attn_logit_softcapping") is not None:
        raise ValueError("attn_logit_softcapping is not supported (Gemma 3 does not use it)")
    if hf.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention=True is not supported (decoder only)")
    rope = hf.get("rope_parameters") or {}
    global_rope = rope.get("full_attention") or {}
    local_rope = rope.get("sliding_attention") or {}
    for kind, params in (("full_attention", global_rope), ("sliding_attention", local_rope)):
        if params.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.{kind}.rope_type={params['rope_type']!r} is not "
                             "supported for gemma3 (default)")
    pattern = hf.get("_sliding_window_pattern", 6)
    layer_types = hf.get("layer_types") or [
        "sliding_attention" if (i + 1) % pattern else "full_attention"
        for i in range(hf["num_hidden_layers"])]
    return ModelConfig(
        family="gemma3",
        num_kv_heads=hf["num_key_value_heads"],
        head_dim=hf["head_dim"],
        mlp_dim=hf["intermediate_size"],
        norm_eps=hf.get("rms_norm_eps", 1e-6),
        mlp_type="geglu",
        rope_theta=float(global_rope.get("rope_theta", hf.get("rope_theta", 1e6))),
        rope_local_theta=float(local_rope.get("rope_theta", hf.get("rope_local_base_freq", 1e4))),
        qkv_bias=bool(hf.get("attention_bias", False)),
        o_bias=bool(hf.get("attention_bias", False)),
        sliding_window=hf.get("sliding_window"),
        layer_types=tuple(layer_types),
        qk_norm=True,
        sandwich_norm=True,
        embed_scale=float(hf["hidden_size"]) ** 0.5,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", hf["head_dim"])),
        final_logit_softcap=hf.get("final_logit_softcapping"),
        **common,
    )
