"""Chat prompts for instruct models: an explicit ChatML formatter (SmolLM2, Qwen2, ...).

ChatML: every message is `<|im_start|>{role}\n{content}<|im_end|>\n`; the generation prompt is
`<|im_start|>assistant\n`. SmolLM2's template inserts a default system message when the
conversation does not start with one — `default_system` does the same.
"""

from __future__ import annotations

from typing import Sequence

SMOLLM2_DEFAULT_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def format_chatml(messages: Sequence[dict], add_generation_prompt: bool = True,
                  default_system: str | None = None) -> str:
    """messages: [{"role": "user" | "assistant" | "system", "content": str}, ...] -> prompt text."""
    messages = list(messages)
    for m in messages:
        if set(m) < {"role", "content"} or not isinstance(m.get("content"), str):
            raise ValueError(f"chat message needs 'role' and string 'content': {m!r}")
    if default_system is not None and (not messages or messages[0]["role"] != "system"):
        messages.insert(0, {"role": "system", "content": default_system})
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


def is_chatml_template(template: str | None) -> bool:
    """True when a Jinja chat_template (from GGUF or tokenizer_config.json) is ChatML."""
    return bool(template) and "<|im_start|>" in template and "<|im_end|>" in template
