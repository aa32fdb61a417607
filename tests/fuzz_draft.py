"""Seeded fuzzer for DFlash draft GGUF loading: hostile files must give a specific error, never a
crash or a hang.

Each case mutates a valid draft GGUF in one way (a KV's type tag or value, an array's length, a
tensor's rank, dims, type or offset, a truncation, flipped bits) and loads it against its target
in a worker process through `_core.Draft`, then runs one draft step; with --server, also through
`llama-server --model-draft`. A case passes when the file loads and steps, or is refused with a
message; it fails on a signal, an exit without a verdict, or a timeout.

    python tests/fuzz_draft.py --cases 1000 --seed 0 [--server-every 10] [--report out.json] [--family dflash2|dspark]

tests/test_fuzz.py runs a small slice of it in the default test run.
"""

from __future__ import annotations

import os
import random
import struct
import sys
import tempfile
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from fuzzing import Case, Progress, Worker, arguments, finish

WORKER = r"""
import sys
import numpy as np
from ikdflash import _core
model = _core.Model(sys.argv[1], n_ctx=256, n_threads=1)
for line in sys.stdin:
    path = line.strip()
    try:
        draft = _core.Draft(model, path, n_threads=1)
        info = draft.info()
        features = np.ones((3, info["n_target_features"]), dtype=np.float32)
        draft.forward(features, np.arange(3, dtype=np.int32), 1, 3, cross_ctx=64)
        draft.close()
        print("LOADED", flush=True)
    except (ValueError, RuntimeError) as e:
        print("REFUSED", str(e).replace("\n", " ")[:300], flush=True)
"""


# A scalar header value's extremes by type: struct format and values (NaN and infinities for floats).
_T = gguf.GGUFValueType
EXTREMES = {
    _T.FLOAT32: ("f", [float("nan"), float("inf"), float("-inf"), 0.0, -0.0, -1.0, 3.4028235e38, -3.4028235e38,
                       1e-45, 1e-30]),
    _T.UINT32: ("I", [0, 1, 2**31 - 1, 2**31, 2**32 - 1]),
    _T.INT32: ("i", [0, 1, -1, 2**31 - 1, -2**31]),
    _T.UINT64: ("Q", [0, 1, 2**63 - 1, 2**64 - 1]),
    _T.INT64: ("q", [0, -1, 2**63 - 1, -2**63]),
    _T.BOOL: ("B", [0, 1, 2, 255]),
}


class Mutator:
    """One valid draft's bytes and the layout of its header (where each KV and tensor info sits)."""

    def __init__(self, draft: Path) -> None:
        self.data = draft.read_bytes()
        reader = gguf.GGUFReader(draft)
        base = reader.data.ctypes.data

        def where(part: np.ndarray) -> tuple[int, int]:
            return part.ctypes.data - base, part.nbytes

        # per KV: (type tag, value parts); an array's parts are item type, count, items
        self.kvs = [(where(f.parts[2]), [where(p) for p in f.parts[3:]], f.types)
                    for k, f in reader.fields.items() if not k.startswith("GGUF.")]
        # per tensor info: name length, name, n_dims, dims..., type, offset
        self.tensors = [[where(p) for p in t.field.parts] for t in reader.tensors]
        self.header_end = min(int(t.data_offset) for t in reader.tensors)

    def mutate(self, rng: random.Random) -> tuple[str, bytes]:
        kind = rng.choice(["kv_type", "kv_value", "kv_extreme", "array_length", "tensor_rank", "tensor_dim",
                           "tensor_type", "tensor_offset", "truncate", "bit_flips"])
        data = bytearray(self.data)
        if kind == "kv_type":
            (off, _), _, _ = rng.choice(self.kvs)
            value = rng.randrange(0, 14)
            data[off:off + 4] = value.to_bytes(4, "little")
            return f"{kind}={value}@{off}", bytes(data)
        if kind == "kv_extreme":
            scalars = [kv for kv in self.kvs if kv[2][0] in EXTREMES]
            _, parts, types = rng.choice(scalars)
            off, size = parts[-1]
            fmt, values = EXTREMES[types[0]]
            value = rng.choice(values)
            data[off:off + size] = struct.pack("<" + fmt, value)
            return f"{kind}={value}@{off}", bytes(data)
        if kind in ("kv_value", "array_length"):
            candidates = [kv for kv in self.kvs if (kv[2][0] == gguf.GGUFValueType.ARRAY) == (kind == "array_length")]
            _, parts, types = rng.choice(candidates)
            off, size = parts[1] if kind == "array_length" else parts[-1]
            value = rng.choice([0, 1, 2, 3, 7, 255, 4096, 2**31 - 1, 2**31, 2**32 - 1, 2**63 - 1, 2**64 - 1,
                                rng.randrange(2**(8 * min(size, 8)))])
            width = min(size, 8)
            data[off:off + width] = (value % 2**(8 * width)).to_bytes(width, "little")
            return f"{kind}={value}@{off}", bytes(data)
        if kind.startswith("tensor_"):
            parts = rng.choice(self.tensors)
            n_dims_at = parts[2][0]
            if kind == "tensor_rank":
                value = rng.choice([0, 1, 2, 3, 4, 5, 2**31])
                data[n_dims_at:n_dims_at + 4] = value.to_bytes(4, "little")
            elif kind == "tensor_dim":
                off, size = parts[3]
                at = off + 8 * rng.randrange(size // 8)
                value = rng.choice([0, 1, 2, 3, 17, 4096, 2**31, 2**40, 2**63 - 1, 2**64 - 1])
                data[at:at + 8] = value.to_bytes(8, "little")
            elif kind == "tensor_type":
                off, _ = parts[4]
                value = rng.choice([1, 2, 3, 6, 8, 10, 12, 14, 15, 16, 20, 30, 39, 40, 41, 100, 2**31])
                data[off:off + 4] = value.to_bytes(4, "little")
            else:
                off, _ = parts[5]
                value = rng.choice([1, 31, 32, len(self.data), 2**40, 2**64 - 32, rng.randrange(len(self.data))])
                data[off:off + 8] = value.to_bytes(8, "little")
            return f"{kind}={value}", bytes(data)
        if kind == "truncate":
            cut = rng.randrange(len(self.data))
            return f"{kind}={cut}", bytes(data[:cut])
        flips = []
        for _ in range(rng.randint(1, 8)):
            # mostly in the header, where a flipped bit changes meaning rather than a weight
            at = rng.randrange(self.header_end if rng.random() < 0.8 else len(data))
            bit = rng.randrange(8)
            data[at] ^= 1 << bit
            flips.append(f"{at}.{bit}")
        return f"{kind}={','.join(flips)}", bytes(data)


def load_in_server(target: Path, draft: Path, log: Path, timeout: float) -> tuple[str, str]:
    from ikdflash import Server, ServerError
    from ikdflash.serving.client import post_json
    server = Server(target, ctx_size=256, n_threads=1, log_file=log, startup_timeout=timeout,
                    extra_args=["--model-draft", str(draft), "--spec-type", "dflash:n_max=4"])
    try:
        with server as url:
            post_json(url + "/completion", {"prompt": "hello", "n_predict": 4, "temperature": 0}, timeout=timeout)
        return "loaded", ""
    except ServerError as e:
        text = str(e)
        if "exited with code 1 " in text:
            errors = [line for line in log.read_text(errors="replace").splitlines() if "error" in line.lower()]
            return "refused", (errors[-1] if errors else text)[-300:]
        if "did not become ready" in text or "timed out" in text:
            return "hang", text[-300:]
        return "crash", text[-300:]


def run(target: Path, draft: Path, cases: int, seed: int, server_every: int = 0, timeout: float = 20.0,
        progress=lambda case: None) -> list[Case]:
    mutator = Mutator(draft)
    rng = random.Random(seed)
    worker = Worker(WORKER, [str(target)], ("LOADED", "REFUSED"), timeout)
    results = []
    with tempfile.TemporaryDirectory(prefix="ikdflash-fuzz-") as folder:
        try:
            for index in range(cases):
                mutation, data = mutator.mutate(rng)
                path = Path(folder) / f"case-{index}.gguf"
                path.write_bytes(data)
                outcome, detail = worker.judge(str(path))
                results.append(Case(index, mutation, "core", outcome, detail))
                progress(results[-1])
                if server_every and index % server_every == 0:
                    outcome, detail = load_in_server(target, path, Path(folder) / "server.log", timeout)
                    results.append(Case(index, mutation, "server", outcome, detail))
                    progress(results[-1])
                path.unlink()
        finally:
            worker.close()
    return results


def main() -> int:
    parser = arguments(__doc__.split("\n\n")[0], timeout=20.0)
    parser.add_argument("--server-every", type=int, default=10, help="also load every N-th case in llama-server")
    parser.add_argument("--target", type=Path, help="target GGUF (default: a tiny llama made here)")
    parser.add_argument("--draft", type=Path, help="draft GGUF to mutate (default: a tiny draft for the target)")
    parser.add_argument("--family", choices=sorted(FAMILIES), help="the default tiny draft's family (default DFlash1)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="ikdflash-fuzz-pair-") as folder:
        target, draft = args.target, args.draft
        if target is None or draft is None:
            target, draft = tiny_pair(Path(folder), FAMILIES.get(args.family, {}))
        progress = Progress(args.cases)
        results = run(target, draft, args.cases, args.seed, args.server_every, args.timeout, progress)
    return finish(results, progress, args.report)


# write_tiny_draft's options for a small draft of each other family, with every key and tensor of
# its format: DFlash2 with two taps and a few candidates; DSpark with both heads, anchor-first
FAMILIES: dict[str, dict[str, Any]] = {
    "dflash2": {"dflash2": {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 4}},
    "dspark": {"dspark": {"markov_rank": 32}},
}


def tiny_pair(folder: Path, family: dict[str, Any]) -> tuple[Path, Path]:
    """A tiny llama target and a 3-layer sliding-window draft of a family (FAMILIES; {}: DFlash1)
    converted for it."""
    from fixtures.tinydraft import converted_tiny_draft, write_hf_target
    from fixtures.tinymodels import write_tiny_model
    target = write_tiny_model(folder / "target.gguf", arch="llama")
    hf = write_hf_target(folder / "target-hf", target)
    return target, converted_tiny_draft(folder, hf, outtype="q8_0", target_layer_ids=[0, 2], block_size=8,
                                        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                                        sliding_window=8, **family)[1]


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
