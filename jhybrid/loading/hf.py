"""Hugging Face folders: config.json + model.safetensors (or a sharded model.safetensors.index.json)."""

from __future__ import annotations

import json
import os
import re
from typing import Callable

import numpy as np
from safetensors import safe_open

from jhybrid.loading.params import ParamSource, build_model, transpose
from jhybrid.models.config import ModelConfig, from_hf_config
from jhybrid.models.decoder import CausalLM


def hf_config_path(name: str) -> str | None:
    """The config.json a model name refers to: a `*.json` path itself, or a Hugging Face folder's
    config.json; None for anything else (a known name, a GGUF, a folder without one)."""
    if name.endswith(".json"):
        return name
    path = os.path.join(name, "config.json")
    return path if os.path.isdir(name) and os.path.isfile(path) else None


def read_hf_config(folder_or_file: str) -> ModelConfig:
    """The ModelConfig of a Hugging Face folder's config.json (or of a config.json path). Every
    problem is a ValueError (FileNotFoundError when there is no file) naming the file and what was
    expected: not JSON, not an object, a missing field, a value of the wrong type or range."""
    path = folder_or_file
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"{folder_or_file}: no config.json (not a Hugging Face model folder)")
    from jhybrid.config.files import read_json

    expected = "expected a Hugging Face config.json"
    try:
        hf = read_json(path, expected)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such config.json") from None
    if not isinstance(hf, dict):
        raise ValueError(f"{path}: holds a JSON {type(hf).__name__}, not an object; {expected}")
    try:
        return from_hf_config(hf)
    except KeyError as error:
        raise ValueError(f"{path}: field {error.args[0]!r} is missing (model_type "
                         f"{hf.get('model_type')!r} needs it); {expected} with every field of its "
                         "architecture") from None
    except (TypeError, ZeroDivisionError, AttributeError) as error:
        raise ValueError(f"{path}: a field has a value of the wrong type or range ({error}); "
                         f"{expected}") from None
    except ValueError as error:
        raise ValueError(f"{path}: {error}") from None


class SafetensorsFiles:
    """Name -> tensor over one file or a sharded set, opened lazily (reads one tensor at a time)."""

    def __init__(self, folder: str):
        self.folder = folder
        index = os.path.join(folder, "model.safetensors.index.json")
        single = os.path.join(folder, "model.safetensors")
        if os.path.exists(index):
            with open(index) as f:
                self.file_of = {name: os.path.join(folder, file)
                                for name, file in json.load(f)["weight_map"].items()}
        elif os.path.exists(single):
            self.file_of = {name: single for name in self._open(single).keys()}
        else:
            raise FileNotFoundError(
                f"{folder}: no model.safetensors or model.safetensors.index.json")
        absent = sorted({f for f in self.file_of.values() if not os.path.exists(f)})
        if absent:
            names = [n for n, f in self.file_of.items() if f == absent[0]]
            raise FileNotFoundError(
                f"{folder}: missing shard file(s) {', '.join(map(os.path.basename, absent))} "
                f"(listed in model.safetensors.index.json; holds e.g. {names[0]})")
        self._handles = {}

    @staticmethod
    def _open(path: str):
        try:
            return safe_open(path, framework="numpy")
        except Exception as error:  # safetensors raises its own error types for bad headers
            raise ValueError(f"{path}: cannot read safetensors file ({error}); "
                             "is it truncated or corrupt?") from error

    def names(self) -> list[str]:
        return list(self.file_of)

    def __call__(self, name: str) -> np.ndarray:
        file = self.file_of[name]  # KeyError -> reported as missing by build_model
        if file not in self._handles:
            self._handles[file] = self._open(file)
        try:
            return self._handles[file].get_tensor(name)
        except Exception as error:
            raise ValueError(f"{file}: cannot read tensor {name} ({error}); "
                             "is the file truncated?") from error


def _linear(prefix: str, ours: tuple, bias: bool) -> dict[tuple, ParamSource]:
    out = {ours + ("kernel",): ParamSource(prefix + ".weight", transpose)}
    if bias:
        out[ours + ("bias",)] = ParamSource(prefix + ".bias")
    return out


def _plus_one(w: np.ndarray) -> np.ndarray:
    return w + 1.0


def _norm(prefix: str, ours: tuple, with_bias: bool, gemma: bool = False) -> dict[tuple, ParamSource]:
    """Norm weights; Gemma's RMSNorm scales by (1 + weight), stored here as the scale."""
    out = {ours + ("scale",): ParamSource(prefix + ".weight", _plus_one if gemma else (lambda w: w))}
    if with_bias:
        out[ours + ("bias",)] = ParamSource(prefix + ".bias")
    return out


def hf_param_sources(config: ModelConfig) -> dict[tuple, ParamSource]:
    """Our parameter path -> HF tensor name (+ layout transform), for every family."""
    ln = config.norm_type == "layer"
    gemma = config.family == "gemma3"
    sources: dict[tuple, ParamSource] = {}
    if config.family in ("llama", "gemma3"):
        top, layer_prefix = "model", "model.layers"
        names = dict(attn="self_attn", q="q_proj", k="k_proj", v="v_proj", o="o_proj",
                     norm1="input_layernorm", norm2="post_attention_layernorm", final="model.norm",
                     embed="model.embed_tokens", head="lm_head")
    elif config.family == "opt":
        top, layer_prefix = "model.decoder", "model.decoder.layers"
        names = dict(attn="self_attn", q="q_proj", k="k_proj", v="v_proj", o="out_proj",
                     norm1="self_attn_layer_norm", norm2="final_layer_norm",
                     final="model.decoder.final_layer_norm", embed="model.decoder.embed_tokens",
                     head="lm_head", fc1="fc1", fc2="fc2")
        sources[("position_embed", "embedding")] = ParamSource("model.decoder.embed_positions.weight")
    else:  # gpt_neox: the fused query_key_value is split in neox_sources below
        top, layer_prefix = "gpt_neox", "gpt_neox.layers"
        names = dict(attn="attention", o="dense", norm1="input_layernorm",
                     norm2="post_attention_layernorm", final="gpt_neox.final_layer_norm",
                     embed="gpt_neox.embed_in", head="embed_out", fc1="mlp.dense_h_to_4h",
                     fc2="mlp.dense_4h_to_h")
    sources[("embed", "embedding")] = ParamSource(names["embed"] + ".weight")
    if config.norm_before:
        sources.update(_norm(names["final"], ("final_norm",), ln, gemma))
    if not config.tie_embeddings:
        sources.update(_linear(names["head"], ("lm_head",), False))
    for i in range(config.num_layers):
        p, ours = f"{layer_prefix}.{i}", ("layers", i)
        attn = ours + ("attention",)
        sources.update(_norm(f"{p}.{names['norm1']}", ours + ("input_norm",), ln, gemma))
        if gemma:
            sources.update(_norm(f"{p}.pre_feedforward_layernorm", ours + ("pre_mlp_norm",), ln, True))
            sources.update(_norm(f"{p}.post_attention_layernorm", ours + ("attn_output_norm",), ln, True))
            sources.update(_norm(f"{p}.post_feedforward_layernorm", ours + ("mlp_output_norm",), ln, True))
            sources.update(_norm(f"{p}.self_attn.q_norm", attn + ("q_norm",), ln, True))
            sources.update(_norm(f"{p}.self_attn.k_norm", attn + ("k_norm",), ln, True))
        else:
            sources.update(_norm(f"{p}.{names['norm2']}", ours + ("pre_mlp_norm",), ln))
        if config.family == "gpt_neox":
            sources.update(_neox_qkv_sources(config, f"{p}.attention.query_key_value", attn))
        else:
            for ours_name, key in (("q_proj", "q"), ("k_proj", "k"), ("v_proj", "v")):
                sources.update(_linear(f"{p}.{names['attn']}.{names[key]}", attn + (ours_name,),
                                       config.qkv_bias))
        sources.update(_linear(f"{p}.{names['attn']}.{names['o']}", attn + ("o_proj",), config.o_bias))
        if config.mlp_type in ("swiglu", "geglu"):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                sources.update(_linear(f"{p}.mlp.{proj}", ours + ("mlp", proj), config.mlp_bias))
        else:
            sources.update(_linear(f"{p}.{names['fc1']}", ours + ("mlp", "fc1"), config.mlp_bias))
            sources.update(_linear(f"{p}.{names['fc2']}", ours + ("mlp", "fc2"), config.mlp_bias))
    return sources


def _neox_qkv_sources(config: ModelConfig, prefix: str, attn: tuple) -> dict[tuple, ParamSource]:
    """GPT-NeoX fuses q, k, v per head: rows are [H, 3, D] (q, k, v of head 0, then head 1, ...)."""
    heads, head_dim = config.num_heads, config.head_dim

    def pick(which: int, is_bias: bool) -> Callable[[np.ndarray], np.ndarray]:
        def transform(w):
            part = w.reshape(heads, 3, head_dim, *w.shape[1:])[:, which]
            part = part.reshape(heads * head_dim, *w.shape[1:])
            return part if is_bias else transpose(part)
        return transform

    out = {}
    for which, name in enumerate(("q_proj", "k_proj", "v_proj")):
        out[attn + (name, "kernel")] = ParamSource(prefix + ".weight", pick(which, False))
        if config.qkv_bias:
            out[attn + (name, "bias")] = ParamSource(prefix + ".bias", pick(which, True))
    return out


def _check_layer_count(config: ModelConfig, names: list[str], folder: str) -> None:
    found = {int(m.group(1)) for n in names if (m := re.search(r"\.layers\.(\d+)\.", n))}
    if found and max(found) + 1 != config.num_layers:
        raise ValueError(f"{folder}: weights hold {max(found) + 1} layers but config field "
                         f"num_hidden_layers is {config.num_layers}")


def load_hf_model(folder: str, dtype: str | None = None, progress=None) -> CausalLM:
    """Loads a Hugging Face folder (config.json + safetensors) into a CausalLM.

    dtype: e.g. "bfloat16" for parameters and activations (default float32).
    """
    config = read_hf_config(folder)
    if dtype is not None:
        config = config.replace(dtype=str(dtype))
    files = SafetensorsFiles(folder)
    _check_layer_count(config, files.names(), folder)
    return build_model(config, hf_param_sources(config), files, folder, param_dtype=dtype,
                       progress=progress)
