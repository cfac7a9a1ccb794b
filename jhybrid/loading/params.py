"""Filling a model's parameters from named tensors, with errors that say what is wrong.

A loader describes, for every parameter of `CausalLM`, which source tensor feeds it and how to
bring it into our layout (`ParamSource`). `build_model` creates the model abstractly (no random
init, no memory), checks every shape, and sets the real arrays.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jhybrid.models.config import ModelConfig
from jhybrid.models.decoder import CausalLM

# Which config.json fields decide the shape of a parameter (named in shape-mismatch errors).
_SHAPE_FIELDS = {
    "embed": "vocab_size / hidden_size",
    "position_embed": "max_position_embeddings / hidden_size",
    "q_proj": "num_attention_heads / head_dim / hidden_size",
    "k_proj": "num_key_value_heads / head_dim / hidden_size",
    "v_proj": "num_key_value_heads / head_dim / hidden_size",
    "o_proj": "num_attention_heads / head_dim / hidden_size",
    "mlp": "intermediate_size (ffn_dim for OPT) / hidden_size",
    "norm": "hidden_size",
    "lm_head": "vocab_size / hidden_size",
}


@dataclasses.dataclass(frozen=True)
class ParamSource:
    """One parameter: the source tensor's name and the function bringing it to our layout."""

    name: str
    transform: Callable[[np.ndarray], np.ndarray] = lambda w: w


def transpose(w: np.ndarray) -> np.ndarray:
    """PyTorch Linear weight [out, in] -> NNX kernel [in, out]."""
    return np.ascontiguousarray(w.T)


def _field_hint(path: tuple) -> str:
    for key, fields in _SHAPE_FIELDS.items():
        if any(key in str(part) for part in path):
            return fields
    return "hidden_size"


def _param_paths(model: CausalLM) -> list[tuple]:
    return [path for path, node in nnx.iter_graph(model) if isinstance(node, nnx.Param)]


def _variable(model: CausalLM, path: tuple) -> nnx.Param:
    node = model
    for part in path:
        node = node[part] if isinstance(part, int) else getattr(node, part)
    return node


def build_model(
    config: ModelConfig,
    sources: dict[tuple, ParamSource],
    read: Callable[[str], np.ndarray],
    where: str,
    param_dtype=None,
    progress: Callable[[int, int], None] | None = None,
) -> CausalLM:
    """Creates CausalLM(config) with every parameter read from `sources`.

    sources: our parameter path (e.g. ("layers", 0, "attention", "q_proj", "kernel")) -> ParamSource.
    read: source tensor name -> array (raises KeyError when the tensor is absent).
    where: the file or folder named in errors. param_dtype: cast parameters (None keeps float32).
    progress(done, total) is called after each parameter (for a progress bar).
    """
    model = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    missing = []
    paths = _param_paths(model)
    for done, path in enumerate(paths, 1):
        if progress is not None:
            progress(done, len(paths))
        source = sources.get(path)
        if source is None:
            raise ValueError(f"{where}: no weight mapping for parameter {'.'.join(map(str, path))}")
        try:
            raw = read(source.name)
        except KeyError:
            missing.append(source.name)
            continue
        array = source.transform(np.asarray(raw, dtype=np.float32))
        variable = _variable(model, path)
        expected = tuple(variable.get_value().shape)
        if tuple(array.shape) != expected:
            raise ValueError(
                f"{where}: tensor {source.name} has shape {tuple(raw.shape)}, which does not fit the "
                f"config (expects {expected} in our [in, out] layout); check config field(s) "
                f"{_field_hint(path)}"
            )
        variable.set_value(jnp.asarray(array, dtype=param_dtype or jnp.float32))
    if missing:
        shown = ", ".join(missing[:8]) + (f" ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise ValueError(f"{where}: missing weight tensor(s): {shown} "
                         "(file truncated or incomplete, or num_hidden_layers too large?)")
    return model
