"""A GGUF model's own chat template (its `tokenizer.chat_template` Jinja text), rendered in Python.

    template = chat_template("target.gguf")
    text = render(template, [("user", "Hello")], add_generation_prompt=True)

Models without a template get ChatML, the format of most small instruct models.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

from ikdflash.gguf_files import gguf_field, open_gguf

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def chat_template(model: str | os.PathLike[str]) -> str:
    return str(gguf_field(open_gguf(model, "target"), "tokenizer.chat_template", CHATML))


def messages_of(messages: Sequence[Mapping[str, str] | tuple[str, str]]) -> list[tuple[str, str]]:
    """(role, content) pairs from OpenAI-style {"role", "content"} dicts or from pairs."""
    out = []
    for message in messages:
        if isinstance(message, Mapping):
            if "role" not in message or "content" not in message:
                raise ValueError(f"a chat message needs 'role' and 'content': {dict(message)}")
            message = (message["role"], message["content"])
        role, content = message
        out.append((str(role), str(content)))
    return out


def render(template: str, messages: Sequence[tuple[str, str]], *, add_generation_prompt: bool = False) -> str:
    """The template applied to (role, content) messages, as llama-server's Jinja path does."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(template).render(
        messages=[{"role": role, "content": content} for role, content in messages],
        add_generation_prompt=add_generation_prompt, bos_token="", eos_token="")
