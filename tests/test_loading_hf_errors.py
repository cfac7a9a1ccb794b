"""Bad Hugging Face folders fail with the path and the missing piece or the config field named."""

from __future__ import annotations

import json
import os

import pytest
from safetensors.numpy import load_file, save_file

from jhybrid.loading.hf import load_hf_model
from jhybrid.models import from_hf_config
from tests.hf_reference import make_hf_model, save_hf_model


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory):
    return save_hf_model(make_hf_model("llama"), tmp_path_factory.mktemp("llama"))


def _copy(folder, tmp_path, config_changes=None, drop_tensor=None):
    config = json.load(open(os.path.join(folder, "config.json")))
    config.update(config_changes or {})
    json.dump(config, open(tmp_path / "config.json", "w"))
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    if drop_tensor:
        del tensors[drop_tensor]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return str(tmp_path)


def test_unknown_architecture_lists_supported():
    with pytest.raises(ValueError, match="unsupported architecture 'bert'.*llama.*opt.*gpt_neox"):
        from_hf_config({"model_type": "bert"})


def test_config_field_disagreeing_with_shapes_is_named(llama_folder, tmp_path):
    folder = _copy(llama_folder, tmp_path, {"intermediate_size": 40})
    with pytest.raises(ValueError, match="mlp.*intermediate_size"):
        load_hf_model(folder)


def test_too_many_layers_in_config(llama_folder, tmp_path):
    folder = _copy(llama_folder, tmp_path, {"num_hidden_layers": 3})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        load_hf_model(folder)


def test_missing_tensor_is_named(llama_folder, tmp_path):
    folder = _copy(llama_folder, tmp_path, drop_tensor="model.layers.1.mlp.up_proj.weight")
    with pytest.raises(ValueError, match="missing weight.*model.layers.1.mlp.up_proj.weight"):
        load_hf_model(folder)


def test_truncated_safetensors_names_the_file(llama_folder, tmp_path):
    folder = _copy(llama_folder, tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_hf_model(folder)


def test_sharded_index_with_missing_shard(llama_folder, tmp_path):
    folder = _copy(llama_folder, tmp_path)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    os.remove(tmp_path / "model.safetensors")
    index = {"weight_map": {n: ("model-00001-of-00002.safetensors" if i < half else
                                "model-00002-of-00002.safetensors") for i, n in enumerate(names)}}
    json.dump(index, open(tmp_path / "model.safetensors.index.json", "w"))
    assert load_hf_model(folder).config.num_layers == 2  # the sharded folder loads
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors"):
        load_hf_model(folder)


def test_missing_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_model(str(tmp_path))
    json.dump({"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
               "num_attention_heads": 2, "intermediate_size": 16,
               "max_position_embeddings": 32}, open(tmp_path / "config.json", "w"))
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_hf_model(str(tmp_path))
