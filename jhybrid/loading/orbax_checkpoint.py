"""Orbax checkpoints of a loaded model, for fast reloads (convert a GGUF/HF model once).

Folder layout: jhybrid_config.json (ModelConfig), params/ (Orbax StandardCheckpointer of the
NNX parameter state), and optionally tokenizer.json + chat.json written by `jhybrid.loading.pretrained`.
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp
from flax import nnx

from jhybrid.models.config import ModelConfig
from jhybrid.models.decoder import CausalLM

CONFIG_FILE = "jhybrid_config.json"


def save_orbax(model: CausalLM, folder: str) -> None:
    folder = os.path.abspath(folder)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, CONFIG_FILE), "w") as f:
        f.write(model.config.to_json())
    _, state = nnx.split(model)
    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(os.path.join(folder, "params"), state, force=True)
    checkpointer.wait_until_finished()


def is_orbax_folder(folder: str) -> bool:
    return os.path.exists(os.path.join(folder, CONFIG_FILE))


def load_config(folder: str) -> ModelConfig:
    """The ModelConfig a converted folder records (ValueError naming the file if it does not read)."""
    from jhybrid.config.files import read_text

    path = os.path.join(os.path.abspath(folder), CONFIG_FILE)
    expected = "expected the folder of `jhybrid convert` (convert the model again)"
    text = read_text(path, expected)
    try:
        return ModelConfig.from_json(text)
    except (ValueError, TypeError, KeyError, AttributeError) as error:  # JSON or field errors
        raise ValueError(f"{path}: not a model config written by jhybrid convert ({error}); {expected}") from None


def load_orbax(folder: str) -> CausalLM:
    folder = os.path.abspath(folder)
    params = os.path.join(folder, "params")
    if not os.path.exists(params):
        raise FileNotFoundError(f"{folder}: no params/ checkpoint next to {CONFIG_FILE}")
    config = load_config(folder)
    abstract = nnx.eval_shape(lambda: CausalLM(config, rngs=nnx.Rngs(0)))
    graphdef, abstract_state = nnx.split(abstract)
    state = ocp.StandardCheckpointer().restore(params, abstract_state)
    return nnx.merge(graphdef, state)
