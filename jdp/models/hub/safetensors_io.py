"""The safetensors format read and written with numpy alone: no torch, no `safetensors` package.

A file is an 8-byte little-endian header length N, N bytes of JSON (`{name: {"dtype", "shape",
"data_offsets": [begin, end]}}` and an optional `"__metadata__"` of strings), then the tensors'
bytes, little-endian and C-ordered, at those offsets from the end of the header
(https://github.com/huggingface/safetensors, its README's "Format"). Reading maps the file and
copies each tensor once; nothing is unpickled.
"""
from __future__ import annotations

import json
import os

import ml_dtypes
import numpy as np

from jdp.text import quoted

# The safetensors dtype names jdp reads (float64/int8… do not occur in a GPT-2 checkpoint but cost nothing).
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
MAX_HEADER = 100_000_000  # the format's own limit on the JSON header (100 MB)


def read_header(path: str) -> tuple[dict, int]:
    """The JSON header of the safetensors file `path` (metadata dropped) and the offset its data starts at;
    ValueError in one sentence for a file that is not safetensors."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 2 <= size <= MAX_HEADER:
            raise ValueError(f"{quoted(path)} is not a safetensors file (its first 8 bytes give a header of {size} "
                             f"bytes).")
        try:
            header = json.loads(f.read(size))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise ValueError(f"{quoted(path)} is not a safetensors file (its header is not JSON).") from None
    if not isinstance(header, dict):
        raise ValueError(f"{quoted(path)} is not a safetensors file (its header is not a JSON object).")
    header.pop("__metadata__", None)
    return header, 8 + size


def tensors(path: str):
    """(name, array) for every tensor of the safetensors file `path`, in the header's order: each array a
    read-only view of the mapped file in its own dtype and shape (nothing is copied; the view keeps the map
    open). ValueError (one sentence) for a dtype outside `DTYPES` or offsets outside the file."""
    header, start = read_header(path)
    data = np.memmap(path, np.uint8, mode="r")
    for name, info in header.items():
        if not isinstance(info, dict) or info.get("dtype") not in DTYPES:
            got = info.get("dtype") if isinstance(info, dict) else info
            raise ValueError(f"{quoted(path)}: tensor {name!r} has dtype {got!r}; jdp reads {', '.join(DTYPES)}.")
        dtype, shape = np.dtype(DTYPES[info["dtype"]]).newbyteorder("<"), tuple(info["shape"])
        begin, end = (start + int(o) for o in info["data_offsets"])
        if end > len(data) or end - begin != dtype.itemsize * int(np.prod(shape, dtype=np.int64)):
            raise ValueError(f"{quoted(path)}: tensor {name!r} ({info['dtype']} {list(shape)}) does not fit its "
                             f"offsets {info['data_offsets']} in a file of {len(data)} bytes; the file is damaged.")
        count = (end - begin) // dtype.itemsize
        yield name, (np.frombuffer(data, dtype, count=count, offset=begin) if count else np.zeros(0, dtype)).reshape(shape)


def load(path: str) -> dict[str, np.ndarray]:
    """Every tensor of the safetensors file `path`, name → a numpy copy of its own dtype and shape.

    ValueError (one sentence) for a dtype outside `DTYPES` or offsets outside the file."""
    return {name: np.array(view, dtype=view.dtype.newbyteorder("=")) for name, view in tensors(path)}


def save(tensors: dict[str, np.ndarray], path: str, metadata: dict[str, str] | None = None) -> None:
    """Write `tensors` (name → numpy array of a dtype in `DTYPES`) to the new safetensors file `path`.

    Tensors are laid out in name order, each little-endian and C-ordered; the header is padded with
    spaces to a multiple of 8 bytes, as the reference writer does. `metadata`: string pairs kept in
    the header ("format": "pt" is what transformers expects)."""
    header, offset, arrays = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        a = a.astype(a.dtype.newbyteorder("<"))
        if np.dtype(a.dtype.newbyteorder("=")) not in _NAMES:
            raise ValueError(f"tensor {name!r} has dtype {a.dtype}; safetensors holds {', '.join(DTYPES)}.")
        header[name] = {"dtype": _NAMES[np.dtype(a.dtype.newbyteorder("="))], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    if metadata:
        header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "xb") as f:  # "x": never overwrite
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for a in arrays:
            f.write(a.tobytes())
        f.flush()
        os.fsync(f.fileno())
