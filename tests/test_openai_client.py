"""The `openai` package pointed at llama-server with DFlash (base_url = url + "/v1"): the path
most users take. Completions and chat, streamed and not, the same text as the target alone; an
API key set on the server is what the client must send."""

from __future__ import annotations

import pytest

from ikdflash import Server

openai = pytest.importorskip("openai")

PROMPT = "the quick brown fox jumps over the lazy dog, and the cat sat on the mat."
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me about rivers."}]


def replies(url: str, key: str) -> dict[str, str]:
    client = openai.OpenAI(base_url=url + "/v1", api_key=key)
    out = {"completion": client.completions.create(model="m", prompt=PROMPT, max_tokens=16, temperature=0,
                                                   extra_body={"ignore_eos": True}).choices[0].text,
           "chat": client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, temperature=0,
                                                  extra_body={"ignore_eos": True}).choices[0].message.content}
    stream = client.chat.completions.create(model="m", messages=MESSAGES, max_tokens=16, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True})
    out["chat streamed"] = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    return out


def test_the_openai_client_gets_the_targets_text(swa_pairs, tmp_path):
    target, draft = swa_pairs["llama"]
    with Server(target, ctx_size=1024, n_threads=2, log_file=tmp_path / "plain.log") as url:
        plain = replies(url, "unused")
    args = ["--model-draft", str(draft), "--spec-type", "dflash:n_max=4"]
    with Server(target, ctx_size=1024, n_threads=2, log_file=tmp_path / "dflash.log", extra_args=args,
                api_key="sk-local-test") as url:
        assert replies(url, "sk-local-test") == plain
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url + "/v1", api_key="wrong").completions.create(model="m", prompt="x",
                                                                                  max_tokens=2)
    assert plain["chat"] == plain["chat streamed"] and all(plain.values())
