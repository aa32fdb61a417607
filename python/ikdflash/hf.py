"""Hugging Face checkpoint folders without torch: config.json, safetensors, tokenizer.json.

The converter reads DFlash drafts and their targets through this module; the test-model
generator writes tiny checkpoints through it, so both sides agree on one reading of the format.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Mapping

import numpy as np

# safetensors dtype name -> (numpy dtype of the stored bytes, how to widen to float32)
_DTYPES = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # numpy has no bfloat16: read the raw 16 bits, widen below
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
}


class CheckpointError(ValueError):
    """A checkpoint folder is missing something or holds something we cannot read."""


def read_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (is {folder} a Hugging Face checkpoint folder?)")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from None


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights found")
    return files


def read_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint as float32 (integers keep their type), by name."""
    tensors: dict[str, np.ndarray] = {}
    for path in _safetensors_files(Path(folder)):
        raw = path.read_bytes()
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file")
        (header_len,) = struct.unpack("<Q", raw[:8])
        try:
            header = json.loads(raw[8:8 + header_len])
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupt safetensors header") from None
        data = memoryview(raw)[8 + header_len:]
        for name, info in header.items():
            if name == "__metadata__":
                continue
            dtype = _DTYPES.get(info["dtype"])
            if dtype is None:
                raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info['dtype']}")
            begin, end = info["data_offsets"]
            if end > len(data):
                raise CheckpointError(f"{path}: tensor {name} runs past the end of the file")
            array = np.frombuffer(data[begin:end], dtype=dtype).reshape(info["shape"])
            if info["dtype"] == "BF16":
                array = (array.astype(np.uint32) << 16).view(np.float32)
            elif array.dtype.kind == "f":
                array = array.astype(np.float32)
            tensors[name] = array
    return tensors


def write_tensors(path: Path, tensors: Mapping[str, np.ndarray]) -> None:
    """Write float32 tensors as one safetensors file (what save_pretrained would write)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    blobs = []
    for name, array in tensors.items():
        blob = np.ascontiguousarray(array, dtype=np.float32).tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
        blobs.append(blob)
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)  # keep the data 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """Multimodal targets keep the language model's settings under text_config."""
    return config.get("text_config", config)
