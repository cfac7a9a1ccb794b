"""Tokenizers: a Hugging Face tokenizer.json, or the byte-level BPE vocabulary inside a GGUF.

Both end up as a `tokenizers.Tokenizer`. For a GGUF we rebuild what Hugging Face's tokenizer.json
would hold: the BPE model from tokenizer.ggml.tokens/merges, the ByteLevel pre-tokenizer (GPT-2
regex) preceded by single-digit splitting for the StarCoder/SmolLM pre-tokenizer, the ByteLevel
decoder, and control tokens as special tokens.
"""

from __future__ import annotations

import os

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers

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
    """Builds the GGUF's tokenizer: "gpt2" byte-level BPE, or "llama" SentencePiece-style BPE."""
    from jhybrid.loading.gguf_loader import field

    kind = field(reader, "tokenizer.ggml.model")
    if kind == "llama":
        return _sentencepiece_bpe_from_gguf(reader, path)
    if kind != "gpt2":
        raise ValueError(f"{path}: tokenizer.ggml.model={kind!r} is not supported "
                         "(gpt2 byte-level BPE, llama SentencePiece BPE)")
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


def _special_tokens(tokens, types) -> list[AddedToken]:
    return [AddedToken(t, special=True, normalized=False) for t, kind in zip(tokens, types)
            if kind in (_GGUF_TOKEN_CONTROL, _GGUF_TOKEN_USER_DEFINED)]


def _sentencepiece_bpe_from_gguf(reader, path: str) -> Tokenizer:
    """SentencePiece BPE (Gemma, Llama 2) from tokens + scores, as Hugging Face converts it.

    SentencePiece applies the merge whose result has the highest score first, so the merge list
    is every (left, right) split of a vocabulary piece into two pieces, ordered by that score.
    Spaces become "▁"; unknown bytes fall back to <0xNN> tokens.
    """
    from jhybrid.loading.gguf_loader import field

    tokens = field(reader, "tokenizer.ggml.tokens")
    scores = field(reader, "tokenizer.ggml.scores")
    types = field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    if scores is None:
        raise ValueError(f"{path}: tokenizer.ggml.scores is missing (needed for a llama tokenizer)")
    vocab = {token: i for i, token in enumerate(tokens)}
    score = dict(zip(tokens, scores))
    merges = []
    for piece, piece_score in score.items():
        splits = [(piece[:i], piece[i:]) for i in range(1, len(piece))
                  if piece[:i] in vocab and piece[i:] in vocab]
        splits.sort(key=lambda lr: (vocab[lr[0]], vocab[lr[1]]))
        merges.extend((left, right, piece_score) for left, right in splits)
    merges.sort(key=lambda m: m[2], reverse=True)  # stable: ties keep the id order above
    unk_id = field(reader, "tokenizer.ggml.unknown_token_id")
    bpe = models.BPE(vocab=vocab, merges=[(left, right) for left, right, _ in merges],
                     unk_token=None if unk_id is None else tokens[unk_id],
                     fuse_unk=True, byte_fallback=True)
    tokenizer = Tokenizer(bpe)
    normalizer = [normalizers.Replace(" ", "\u2581")]
    if field(reader, "tokenizer.ggml.add_space_prefix", False):
        normalizer.insert(0, normalizers.Prepend("\u2581"))
    tokenizer.normalizer = normalizers.Sequence(normalizer)
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(),
                                           decoders.Fuse()])
    tokenizer.add_special_tokens(_special_tokens(tokens, types))
    return tokenizer
