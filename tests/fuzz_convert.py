"""Seeded fuzzer for `ikdflash convert`: hostile Hugging Face checkpoints must give a
ConversionError that says what is wrong, never a traceback, a crash or a hang.

Each case copies a valid draft checkpoint (two safetensors shards and their index) and its HF
target (config.json, tokenizer.json), changes one thing (a config value's type or size, a
missing key, a safetensors header's dtype, shape, offsets or length, a shard name in the index,
a truncation, flipped bits, a token id), and converts it in a worker process. What converts is
then loaded through `_core.Draft` against the target GGUF. A case passes when it converts, or is
refused with a message; an exception of any other type, a dead worker or a timeout fails it.

    python tests/fuzz_convert.py --cases 1000 --seed 0 [--report out.json]

tests/test_fuzz.py runs a small slice of it in the default test run.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

from fuzzing import Case, Progress, Worker, arguments, finish

WORKER = r"""
import os, resource, sys
from pathlib import Path
# a checkpoint that makes the converter allocate without bound fails the case (MemoryError);
# not under AddressSanitizer, whose shadow memory needs terabytes of address space
if "ASAN_OPTIONS" not in os.environ:
    resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))
from ikdflash import _core
from ikdflash.convert import ConversionError, convert
model = _core.Model(sys.argv[1], n_ctx=256, n_threads=1)
for line in sys.stdin:
    draft, target = line.rstrip("\n").split("\t")
    try:
        out = convert(Path(draft), Path(target), outtype="q8_0", outfile=Path(draft) / "out.gguf", log=lambda _: None)
    except ConversionError as e:
        print("REFUSED", str(e).replace("\n", " ")[:300], flush=True)
        continue
    try:
        _core.Draft(model, str(out), n_threads=1).close()
        print("CONVERTED", flush=True)
    except ValueError as e:
        print("UNLOADABLE", str(e).replace("\n", " ")[:300], flush=True)
"""

# values that are the wrong type, size or sign for some config key
HOSTILE = [None, True, False, -1, 0, 1, 3, 2**31, 2**63, 1e308, -0.5, float("nan"), "", "8", "full_attention",
           [], [0], [0, 0], list(range(300)), {}, {"rope_type": "yarn"}, ["sliding_attention"] * 5]


def _paths(config: dict[str, Any], prefix: tuple = ()) -> list[tuple]:
    """Every key path in a JSON object, nested objects included."""
    out = []
    for key, value in config.items():
        out.append(prefix + (key,))
        if isinstance(value, dict):
            out += _paths(value, prefix + (key,))
    return out


def _set(config: dict[str, Any], path: tuple, value: Any) -> None:
    for key in path[:-1]:
        config = config[key]
    if value is _DROP:
        del config[path[-1]]
    else:
        config[path[-1]] = value


_DROP = object()


class Mutator:
    """A valid checkpoint pair in a folder; each case is a changed copy of it."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.draft_config = json.loads((base / "draft" / "config.json").read_text())
        self.target_config = json.loads((base / "target" / "config.json").read_text())
        self.shards = sorted((base / "draft").glob("*.safetensors"))

    def case(self, rng: random.Random, folder: Path) -> str:
        """Copy the pair into folder and change one thing; returns what was changed."""
        shutil.copytree(self.base, folder)
        draft, target = folder / "draft", folder / "target"
        kind = rng.choice(["draft_config", "draft_config", "target_config", "drop_key", "json_bytes", "tokenizer",
                           "st_dtype", "st_shape", "st_offsets", "st_header_len", "st_truncate", "st_bit_flips",
                           "index"])
        if kind in ("draft_config", "target_config", "drop_key"):
            which = target if kind == "target_config" else draft
            config = json.loads((which / "config.json").read_text())
            path = rng.choice(_paths(config))
            value = _DROP if kind == "drop_key" else rng.choice(HOSTILE)
            _set(config, path, value)
            (which / "config.json").write_text(json.dumps(config))
            return f"{kind}:{'.'.join(path)}={'<dropped>' if value is _DROP else repr(value)[:40]}"
        if kind == "json_bytes":
            path = rng.choice([draft / "config.json", target / "config.json", target / "tokenizer.json",
                               draft / "model.safetensors.index.json"])
            data = bytearray(path.read_bytes())
            cut = rng.randrange(len(data))
            if rng.random() < 0.5:
                data = data[:cut]
            else:
                data[cut] = rng.randrange(256)
            path.write_bytes(bytes(data))
            return f"{kind}:{path.name}@{cut}"
        if kind == "tokenizer":
            tok = json.loads((target / "tokenizer.json").read_text())
            vocab = tok["model"]["vocab"]
            token = rng.choice(sorted(vocab))
            value = rng.choice([-1, 2**24, 2**40, "x", None, 1.5])
            vocab[token] = value
            (target / "tokenizer.json").write_text(json.dumps(tok))
            return f"{kind}:{token!r}={value!r}"
        if kind == "index":
            index_path = draft / "model.safetensors.index.json"
            index = json.loads(index_path.read_text())
            name = rng.choice(sorted(index["weight_map"]))
            value = rng.choice(["/dev/zero", "../target/config.json", "/etc/passwd", "missing.safetensors", "", 7,
                                None, "."])
            index["weight_map"][name] = value
            index_path.write_text(json.dumps(index))
            return f"{kind}:{name}={value!r}"
        return self._safetensors(rng, kind, rng.choice(self.shards).name, draft)

    def _safetensors(self, rng: random.Random, kind: str, shard: str, draft: Path) -> str:
        path = draft / shard
        data = bytearray(path.read_bytes())
        (header_len,) = struct.unpack("<Q", data[:8])
        if kind == "st_truncate":
            cut = rng.randrange(len(data))
            path.write_bytes(bytes(data[:cut]))
            return f"{kind}:{shard}@{cut}"
        if kind == "st_bit_flips":
            flips = []
            for _ in range(rng.randint(1, 8)):
                at = rng.randrange(8 + header_len if rng.random() < 0.8 else len(data))
                data[at] ^= 1 << rng.randrange(8)
                flips.append(str(at))
            path.write_bytes(bytes(data))
            return f"{kind}:{shard}@{','.join(flips)}"
        if kind == "st_header_len":
            value = rng.choice([0, 1, header_len - 1, header_len + 1, len(data), 2**31, 2**63, 2**64 - 1])
            data[:8] = struct.pack("<Q", value)
            path.write_bytes(bytes(data))
            return f"{kind}:{shard}={value}"
        header = json.loads(data[8:8 + header_len])
        name = rng.choice(sorted(k for k in header if k != "__metadata__"))
        entry = header[name]
        if kind == "st_dtype":
            value = rng.choice(["F64", "I8", "U8", "BOOL", "F16", "BF16", "I64", 7, None, ""])
            entry["dtype"] = value
        elif kind == "st_shape":
            shape = entry["shape"]
            value = rng.choice([[], [0], [-1, *shape[1:]], [*shape, 1], shape[::-1], [2**40] * len(shape),
                                ["8"] * len(shape), [1.5] * len(shape), None])
            entry["shape"] = value
        else:
            begin, end = entry["data_offsets"]
            value = rng.choice([[end, begin], [-8, end], [begin, 2**62], [begin, end + 4], [begin + 4, end],
                                [begin], None, [str(begin), str(end)], [2**64, 2**64 + 4]])
            entry["data_offsets"] = value
        encoded = json.dumps(header).encode()
        encoded += b" " * (-len(encoded) % 8)
        path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + bytes(data[8 + header_len:]))
        return f"{kind}:{shard}:{name}={value!r}"


def base_pair(folder: Path) -> tuple[Path, Path]:
    """(the target GGUF, a folder holding draft/ (sharded, with an index) and target/ (HF view))."""
    from ikdflash.sources.hf import read_tensors, write_tensors
    from fixtures.tinydraft import write_hf_target, write_tiny_draft
    from fixtures.tinymodels import write_tiny_model
    target_gguf = write_tiny_model(folder / "target.gguf", arch="llama")
    base = folder / "base"
    write_hf_target(base / "target", target_gguf)
    draft = write_tiny_draft(base / "draft", base / "target", target_layer_ids=[0, 2], block_size=8,
                             layer_types=["sliding_attention", "full_attention"], sliding_window=8)
    tensors = read_tensors(draft)
    (draft / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, members in shards.items():
        write_tensors(draft / shard, {n: tensors[n] for n in members})
    weight_map = {n: shard for shard, members in shards.items() for n in members}
    (draft / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return target_gguf, base


def run(cases: int, seed: int, timeout: float = 30.0, progress=lambda case: None) -> list[Case]:
    results = []
    with tempfile.TemporaryDirectory(prefix="ikdflash-fuzz-convert-") as tmp:
        target_gguf, base = base_pair(Path(tmp))
        mutator = Mutator(base)
        rng = random.Random(seed)
        worker = Worker(WORKER, [str(target_gguf)], ("CONVERTED", "UNLOADABLE", "REFUSED"), timeout)
        try:
            for index in range(cases):
                folder = Path(tmp) / f"case-{index}"
                mutation = mutator.case(rng, folder)
                outcome, detail = worker.judge(f"{folder / 'draft'}\t{folder / 'target'}")
                results.append(Case(index, mutation, "convert", outcome, detail))
                progress(results[-1])
                shutil.rmtree(folder)
        finally:
            worker.close()
    return results


def main() -> int:
    args = arguments(__doc__.split("\n\n")[0], timeout=30.0).parse_args()
    progress = Progress(args.cases)
    return finish(run(args.cases, args.seed, args.timeout, progress), progress, args.report)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
