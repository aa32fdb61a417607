"""Hugging Face checkpoint folders without torch: config.json, safetensors, tokenizer.json.

The converter reads DFlash drafts and their targets through this module; the test-model
generator writes tiny checkpoints through it, so both sides agree on one reading of the format.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path, PurePosixPath
from typing import Any, Mapping

import numpy as np

# safetensors dtype name -> (numpy dtype of the stored bytes, how to widen to float32)
_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # numpy has no bfloat16: read the raw 16 bits, widen below
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
}


class CheckpointError(ValueError):
    """A checkpoint folder is missing something or holds something we cannot read."""


# The safetensors format caps its JSON header at 100 MB; a larger claim is a corrupt file.
MAX_HEADER_BYTES = 100 * 1024 * 1024


def read_json_object(path: Path) -> dict[str, Any]:
    """A JSON file whose top level must be an object; any other content is a CheckpointError."""
    try:
        value = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def read_config(folder: Path) -> dict[str, Any]:
    path = Path(folder) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: not found (is {folder} a Hugging Face checkpoint folder?)")
    return read_json_object(path)


def _shard_path(folder: Path, index: Path, name: Any) -> Path:
    """A shard named by the index: a relative path inside the folder to a regular file (the
    index comes from whoever published the checkpoint; "/dev/zero" or "../x" are refused).
    Symlinks are followed, as the Hugging Face cache links snapshots to its blobs."""
    if not isinstance(name, str) or not name:
        raise CheckpointError(f"{index}: shard name {name!r} is not a file name")
    parts = PurePosixPath(name).parts
    if PurePosixPath(name).is_absolute() or "\\" in name or ".." in parts:
        raise CheckpointError(f"{index}: shard {name!r} is not a path inside the checkpoint folder")
    path = folder / name
    if not path.is_file():
        raise CheckpointError(f"{index}: shard {name!r} is not a file in {folder}")
    return path


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: 'weight_map' must be a non-empty object of tensor -> shard")
        return [_shard_path(folder, index, s) for s in sorted(set(map(str, weight_map.values())))]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights found")
    return files


def _tensor_entry(path: Path, name: str, info: Any, n_data: int) -> tuple[np.dtype, list[int], int, int]:
    """One header entry checked against the format: dtype, shape and a byte range that lies in
    the file and holds exactly shape x dtype bytes."""
    if not isinstance(info, dict):
        raise CheckpointError(f"{path}: tensor {name}: header entry is not an object")
    dtype_name = info.get("dtype")
    dtype = _DTYPES.get(dtype_name) if isinstance(dtype_name, str) else None
    if dtype is None:
        raise CheckpointError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise CheckpointError(f"{path}: tensor {name} has an invalid shape {shape!r}")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise CheckpointError(f"{path}: tensor {name} has invalid data_offsets {offsets!r}")
    begin, end = offsets
    if end > n_data:
        raise CheckpointError(f"{path}: tensor {name} runs past the end of the file")
    expected = math.prod(shape) * dtype.itemsize
    if end - begin != expected:
        raise CheckpointError(f"{path}: tensor {name} holds {end - begin} bytes, but shape {shape} of "
                              f"{info['dtype']} needs {expected}")
    return dtype, shape, begin, end


def read_tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the checkpoint as float32 (integers keep their type), by name."""
    tensors: dict[str, np.ndarray] = {}
    for path in _safetensors_files(Path(folder)):
        size = path.stat().st_size
        if size < 8:
            raise CheckpointError(f"{path}: truncated safetensors file")
        # mapped, not read: a checkpoint may be larger than memory, and only its tensors are copied
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        (header_len,) = struct.unpack("<Q", raw[:8].tobytes())
        if header_len > min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: header length {header_len} does not fit the file ({size} bytes)")
        try:
            header = json.loads(raw[8:8 + header_len].tobytes())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupt safetensors header") from None
        if not isinstance(header, dict):
            raise CheckpointError(f"{path}: corrupt safetensors header (not a JSON object)")
        data = raw[8 + header_len:]
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if name in tensors:
                raise CheckpointError(f"{path}: tensor {name} appears in more than one shard")
            dtype, shape, begin, end = _tensor_entry(path, name, info, len(data))
            array = data[begin:end].view(dtype).reshape(shape)
            if info["dtype"] == "BF16":
                array = (array.astype(np.uint32) << 16).view(np.float32)
            else:
                array = array.astype(np.float32 if array.dtype.kind == "f" else array.dtype)
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
