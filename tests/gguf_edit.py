"""Rewrite a GGUF with some keys or tensors changed: how tests make files that are wrong in
exactly one way."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

import gguf
import numpy as np

DROP = object()  # value meaning "remove this key"


def rewrite(src: Path, dst: Path, *, arch: str | None = None, fields: Mapping[str, Any] | None = None,
            rename_key: Callable[[str], str] = lambda k: k,
            rename_tensor: Callable[[str], str | None] = lambda n: n,
            tensors: Mapping[str, np.ndarray] | None = None) -> Path:
    """Copy src to dst. fields: key -> new value (typed like the old one, or int/float/bool/str/list
    for new keys) or DROP. rename_tensor may return None to drop a tensor. tensors: name -> new
    F32 data (numpy shape), replacing a tensor or adding one."""
    reader = gguf.GGUFReader(src)
    old_arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch or old_arch)
    fields = dict(fields or {})
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        new_key = rename_key(key)
        value = fields.pop(new_key, fields.pop(key, field.contents()))
        if value is DROP:
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY and len(field.types) > 1 else None
        if vtype == gguf.GGUFValueType.ARRAY and sub is None:
            sub = gguf.GGUFValueType.get_type(value[0]) if value else gguf.GGUFValueType.INT32
        writer.add_key_value(new_key, value, vtype, sub)
    for key, value in fields.items():  # keys the file did not have
        if value is DROP:
            continue
        vtype = gguf.GGUFValueType.get_type(value)
        sub = gguf.GGUFValueType.get_type(value[0]) if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, value, vtype, sub)
    replaced = dict(tensors or {})
    for tensor in reader.tensors:
        name = rename_tensor(tensor.name)
        if name is None:
            continue
        if name in replaced:
            writer.add_tensor(name, replaced.pop(name).astype(np.float32))
            continue
        # a quantized tensor's data comes as bytes per row, which the writer reads its shape from
        block_size = gguf.GGML_QUANT_SIZES[tensor.tensor_type][0]
        shape = None if block_size > 1 else [int(n) for n in reversed(tensor.shape)]
        writer.add_tensor(name, np.asarray(tensor.data), raw_shape=shape, raw_dtype=tensor.tensor_type)
    for name, data in replaced.items():
        writer.add_tensor(name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst
