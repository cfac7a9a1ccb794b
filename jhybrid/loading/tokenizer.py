"""Tokenizers: a Hugging Face tokenizer.json, or the byte-level BPE vocabulary inside a GGUF.

Both end up as a `tokenizers.Tokenizer`. For a GGUF we rebuild what Hugging Face's tokenizer.json
would hold: the BPE model from tokenizer.ggml.tokens/merges, the ByteLevel pre-tokenizer (GPT-2
regex) preceded by single-digit splitting for the StarCoder/SmolLM pre-tokenizer, the ByteLevel
decoder, and control tokens as special tokens.
"""

from __future__ import annotations

import os

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

# llama.cpp's tokenizer.ggml.pre values that split every digit on its own before the GPT-2 regex.
_DIGIT_SPLITTING_PRE = {"smollm", "starcoder", "refact", "codeshell"}
_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED = 3, 4


def load_tokenizer_json(folder_or_file: str) -> Tokenizer:
    path = folder_or_file
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: tokenizer.json not found")
    return Tokenizer.from_file(path)


def tokenizer_from_gguf(reader, path: str = "<gguf>") -> Tokenizer:
    """Builds the GGUF's byte-level BPE tokenizer (tokenizer.ggml.model == "gpt2")."""
    from jhybrid.loading.gguf_loader import field

    kind = field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={kind!r} is not supported (gpt2 byte-level BPE)")
    tokens = field(reader, "tokenizer.ggml.tokens")
    merges = field(reader, "tokenizer.ggml.merges")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    vocab = {token: i for i, token in enumerate(tokens)}
    bpe = models.BPE(vocab=vocab, merges=[tuple(m.split(" ", 1)) for m in merges],
                     fuse_unk=False, byte_fallback=False)
    tokenizer = Tokenizer(bpe)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if field(reader, "tokenizer.ggml.pre") in _DIGIT_SPLITTING_PRE:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    special = [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types)
               if kind in (_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED)]
    tokenizer.add_special_tokens(special)
    return tokenizer
