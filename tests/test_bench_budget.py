"""KV budget calculator arithmetic on known shapes, and `jhybrid budget`."""

from __future__ import annotations

import json

import pytest

from jhybrid import cli
from jhybrid.bench.budget import kv_budget, kv_bytes_per_token, parameter_count, parse_bytes, window_for_share
from jhybrid.bench.shapes import SHAPES, model_config_for

GIB = 2**30


def test_kv_bytes_are_gqa_aware():
    # Llama-3-8B, bf16: 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token.
    assert kv_bytes_per_token(SHAPES["llama3-8b"]) == 2 * 32 * 8 * 128 * 2 == 131072
    # SmolLM2-135M, f32: 2 x 30 x 3 KV heads x 64 x 4 = 46,080 bytes.
    assert kv_bytes_per_token(SHAPES["smollm2"]) == 46080
    assert kv_bytes_per_token(SHAPES["smollm2"], "bfloat16") == 23040
    assert parameter_count(SHAPES["llama3-8b"]) == pytest.approx(8.03e9, rel=1e-3)
    assert parameter_count(SHAPES["smollm2"]) == pytest.approx(134.5e6, rel=1e-3)


def test_llama3_8b_128k_on_80gib():
    b = kv_budget("llama3-8b", SHAPES["llama3-8b"], context=131072, batch=4, gpu_bytes=80 * GIB)
    assert b.kv_bytes_per_request == 16 * GIB
    free = 80 * GIB - b.weight_bytes
    assert b.max_batch_full_on_gpu == free // (16 * GIB) == 4 and b.fits_fully_on_gpu
    assert b.window_tokens == 32768  # 16 sinks + 2047 blocks of 16 = a quarter of 128K
    assert b.blocks_to_offload_per_layer == (131072 - 32768) // 16
    assert b.blocks_to_offload_total == b.blocks_to_offload_per_layer * 4 * 32
    blocks = (131072 - 32768) // 16
    assert b.host_kv_bytes == 4 * (131072 - 32768) * 131072 == 48 * GIB
    # by hand, per block and layer: K+V 2*8*16*128*2 = 65536, MAW 8*16*4 = 512, positions 16*8 = 128
    # -> 66176 bytes, x 32 layers x blocks x 4 sequences (+1 %)
    assert b.host_bytes == 4 * blocks * 32 * 66176
    assert b.host_bytes / b.host_kv_bytes == pytest.approx(1.00977, rel=1e-4)
    assert b.max_batch_with_window == free // (32768 * 131072)
    b8 = kv_budget("llama3-8b", SHAPES["llama3-8b"], context=131072, batch=8, gpu_bytes=80 * GIB)
    assert not b8.fits_fully_on_gpu


def test_window_and_bytes_parsing():
    assert window_for_share(1000, 0.25, 16, 16) == 16 + 14 * 16
    assert window_for_share(100, 1.0, 16, 16) == 96
    assert parse_bytes("80") == parse_bytes("80GiB") == 80 * GIB
    assert parse_bytes("80GB") == 80 * 10**9 and parse_bytes("512MiB") == 512 * 2**20
    with pytest.raises(ValueError, match="memory size"):
        parse_bytes("lots")


def test_config_json_and_cli(tmp_path, capsys):
    hf = {"model_type": "llama", "vocab_size": 1000, "hidden_size": 256, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 512,
          "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(hf))
    config = model_config_for(str(path))
    assert config.num_kv_heads == 2 and config.head_dim == 32
    assert cli.main(["budget", "--model", "llama3-8b", "--context", "131072", "--batch", "8",
                     "--gpu-mem", "80GiB"]) == 0
    out = capsys.readouterr().out
    assert "128.0 KiB" in out and "max batch fully on GPU" in out and "32,768 tokens" in out
    assert cli.main(["budget", "--model", "nope", "--context", "10", "--gpu-mem", "1"]) == 2
    assert "unknown model" in capsys.readouterr().err
