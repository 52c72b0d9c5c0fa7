"""A small, torch-free reader for GGUF files (format version 2 and 3).

Layout of a GGUF file (little endian):

    magic "GGUF" | u32 version | u64 tensor_count | u64 kv_count
    kv_count x (string key, u32 value_type, value)
    tensor_count x (string name, u32 n_dims, n_dims x u64 ne, u32 ggml_type, u64 offset)
    padding to `general.alignment` (default 32), then the tensor data region

A string is a u64 byte length followed by UTF-8 bytes. `ne[0]` is the fastest-varying dimension,
so a tensor with ne = [in, out] is the row-major array [out, in] (HF's Linear layout).

The `gguf` package ships a reader too, but it builds numpy views for every array element and
takes ~4 s on SmolLM2's 49k-token vocabulary; this one takes tens of milliseconds. Tensor data is
not read here: `TensorInfo` records where it lies, and `GGUFFile.tensor_bytes` returns a view of
the memory-mapped file.
"""
from __future__ import annotations

import logging
import mmap
import struct
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Metadata value types.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q",
                   11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9

# ggml tensor types: name, elements per block, bytes per block.
GGML_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 36),
    10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110), 12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8),
    28: ("F64", 1, 8), 30: ("BF16", 1, 2),
}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (numpy / torch order): reversed ne
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return GGML_TYPES.get(self.ggml_type, (f"type{self.ggml_type}", 0, 0))[0]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


class _Cursor:
    __slots__ = ("buf", "pos")

    def __init__(self, buf, pos: int = 0) -> None:
        self.buf = buf
        self.pos = pos

    def unpack(self, fmt: str):
        vals = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return vals

    def string(self) -> str:
        (n,) = struct.unpack_from("<Q", self.buf, self.pos)
        start = self.pos + 8
        self.pos = start + n
        return bytes(self.buf[start:self.pos]).decode("utf-8", errors="surrogateescape")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            (etype, count) = self.unpack("IQ")
            return self.array(etype, count)
        fmt = _SCALAR_FORMATS.get(vtype)
        if fmt is None:
            raise ValueError(f"unknown GGUF metadata value type {vtype}")
        return self.unpack(fmt)[0]

    def array(self, etype: int, count: int) -> list:
        if etype == _STRING:
            buf, pos, out = self.buf, self.pos, []
            unpack_q = struct.Struct("<Q").unpack_from
            for _ in range(count):
                (n,) = unpack_q(buf, pos)
                pos += 8
                out.append(bytes(buf[pos:pos + n]).decode("utf-8", errors="surrogateescape"))
                pos += n
            self.pos = pos
            return out
        fmt = _SCALAR_FORMATS.get(etype)
        if fmt is None:  # nested arrays: rare, decode one by one
            return [self.value(etype) for _ in range(count)]
        vals = struct.unpack_from(f"<{count}{fmt}", self.buf, self.pos)
        self.pos += count * struct.calcsize(fmt)
        return list(vals)


class GGUFFile:
    """Metadata and tensor directory of one GGUF file; tensor bytes are memory-mapped."""

    def __init__(self, path: str) -> None:
        self.path = str(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        cur = _Cursor(self._mm)
        if bytes(self._mm[:4]) != GGUF_MAGIC:
            raise ValueError(f"{self.path} is not a GGUF file (bad magic)")
        cur.pos = 4
        (self.version,) = cur.unpack("I")
        if self.version not in (2, 3):
            raise ValueError(f"{self.path}: unsupported GGUF version {self.version}")
        n_tensors, n_kv = cur.unpack("QQ")
        self.metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            (vtype,) = cur.unpack("I")
            self.metadata[key] = cur.value(vtype)
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            (n_dims,) = cur.unpack("I")
            ne = cur.unpack(f"{n_dims}Q")
            ggml_type, offset = cur.unpack("IQ")
            infos.append((name, tuple(reversed(ne)), ggml_type, offset, ne))
        align = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (cur.pos + align - 1) // align * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, shape, ggml_type, offset, ne in infos:
            if ggml_type not in GGML_TYPES:
                raise ValueError(f"{self.path}: tensor {name} has unknown ggml type {ggml_type}")
            _, block, type_size = GGML_TYPES[ggml_type]
            if ne[0] % block:
                raise ValueError(f"{self.path}: tensor {name} row of {ne[0]} is not a multiple "
                                 f"of the block size {block}")
            rows = 1
            for d in ne[1:]:
                rows *= d
            nbytes = rows * (ne[0] // block) * type_size
            self.tensors[name] = TensorInfo(name, shape, ggml_type, data_start + offset, nbytes)

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def tensor_bytes(self, name: str) -> memoryview:
        """Read-only view of one tensor's raw bytes (no copy)."""
        info = self.tensors[name]
        end = info.offset + info.nbytes
        if end > len(self._mm):
            raise ValueError(f"{self.path}: tensor {name} runs past the end of the file")
        return memoryview(self._mm)[info.offset:end]

    def close(self) -> None:
        self._mm.close()

    def __enter__(self) -> "GGUFFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
