"""A GGUF file read from its memory map: metadata fields parsed lazily, tensors as views.

gguf-py's `GGUFReader` builds a numpy part per value of every array, so a 262k-token vocabulary
(Gemma 3) becomes ~1M small arrays: +690 MiB of RSS for a moment and ~20 s, to read a handful of
hyperparameters. Here a string array is only skipped over (its offset and count kept) and decoded
when asked for; numeric arrays are one numpy view of the mapping; scalars are read at once.
Tensors are numpy views of the mapping in gguf-py's shapes (quantized types: bytes per row), and
`release` drops a tensor's pages from this process's RSS once its blocks were copied (the page
cache keeps them; a later read faults them back in).

The format (little-endian; https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): magic
"GGUF", version (2 or 3), tensor count, field count; the fields (key string, value type, value);
the tensor infos (name, dims fastest first, type, offset); the data, aligned to
`general.alignment` (32 by default).
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from tokenpath.engine.ggml_types import GGML_QUANT_SIZES, GGMLType

# GGUF value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array,
# 10 u64, 11 i64, 12 f64.
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, str] = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                            10: "<Q", 11: "<q", 12: "<d"}
_FLOAT_TYPES: dict[int, Any] = {
    GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.F64: np.float64,
    GGMLType.I8: np.int8, GGMLType.I16: np.int16, GGMLType.I32: np.int32, GGMLType.I64: np.int64,
}


class GGUFFormatError(ValueError):
    """The bytes are not a GGUF file this reader understands (the loader names the file)."""


def _ggml_type(tensor: str, raw_type: int) -> tuple[Any, int, int]:
    """(type, values per block, bytes per block) of a tensor's ggml type number. A number newer than
    engine/ggml_types.py's copy is looked up in the installed gguf-py's tables, which may know it."""
    try:
        ttype = GGMLType(raw_type)
        return (ttype, *GGML_QUANT_SIZES[ttype])
    except ValueError:
        pass
    from gguf.constants import GGML_QUANT_SIZES as THEIRS
    from gguf.constants import GGMLQuantizationType

    try:
        theirs = GGMLQuantizationType(raw_type)
        return (theirs, *THEIRS[theirs])
    except (ValueError, KeyError):
        raise GGUFFormatError(f"tensor '{tensor}' has unknown ggml type {raw_type}") from None


class Field:
    """One metadata value. `contents()` as gguf-py's ReaderField gives it: a scalar, a str, or a
    list (string arrays decoded only then); `count` is an array's length without decoding it."""

    __slots__ = ("_decode", "count", "key")

    def __init__(self, key: str, count: int, decode: Callable[[], Any]) -> None:
        self.key, self.count, self._decode = key, count, decode

    def contents(self) -> Any:
        return self._decode()


class Tensor:
    """A tensor's info; `data` is a view of the mapping (gguf-py's ReaderTensor shapes)."""

    __slots__ = ("_file", "n_bytes", "name", "offset", "shape", "tensor_type")

    def __init__(self, file: GGUFFile, name: str, shape: np.ndarray, tensor_type: GGMLType,
                 offset: int, n_bytes: int) -> None:
        self._file, self.name, self.shape, self.tensor_type = file, name, shape, tensor_type
        self.offset, self.n_bytes = offset, n_bytes

    @property
    def data(self) -> np.ndarray:
        raw = self._file.buffer[self.offset:self.offset + self.n_bytes]
        dims = tuple(int(d) for d in reversed(self.shape.tolist()))
        dtype = _FLOAT_TYPES.get(self.tensor_type)
        if dtype is not None:
            return raw.view(dtype).reshape(dims)
        _, block, size = _ggml_type(self.name, int(self.tensor_type))
        return raw.reshape(*dims[:-1], dims[-1] // block * size)


class GGUFFile:
    """The fields and tensors of one GGUF file, read from a read-only memory map."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.buffer = np.frombuffer(self._mm, dtype=np.uint8)
        self._off = 0
        try:
            self._parse()
        except (struct.error, IndexError, UnicodeDecodeError, OverflowError) as exc:
            raise GGUFFormatError(f"malformed at byte {self._off} ({type(exc).__name__}: {exc})") from exc

    def _read(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self._mm, self._off)
        self._off += struct.calcsize(fmt)
        return value

    def _string(self) -> str:
        n = self._read("<Q")
        end = self._off + n
        if end > len(self._mm):
            raise GGUFFormatError(f"a string of {n} bytes at byte {self._off} runs past the end of the file")
        text = self._mm[self._off:end].decode("utf-8")
        self._off = end
        return text

    def _parse(self) -> None:
        if self._mm[:4] != b"GGUF":
            raise GGUFFormatError("no GGUF magic")
        self._off = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise GGUFFormatError(f"GGUF version {version} (supported: 2, 3)")
        n_tensors, n_fields = self._read("<Q"), self._read("<Q")
        self.fields: dict[str, Field] = {}
        for _ in range(n_fields):
            key = self._string()
            self.fields[key] = self._value(key, self._read("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._read("<I")
            dims = np.array(struct.unpack_from(f"<{n_dims}Q", self._mm, self._off), dtype=np.uint64)
            self._off += 8 * n_dims
            infos.append((name, dims, self._read("<I"), self._read("<Q")))
        align_field = self.fields.get("general.alignment")
        align = int(align_field.contents()) if align_field is not None else 32
        start = -(-self._off // align) * align
        self.tensors: list[Tensor] = []
        for name, dims, raw_type, offset in infos:
            ttype, block, size = _ggml_type(name, raw_type)
            n_bytes = int(np.prod(dims, dtype=np.uint64)) // block * size
            if start + offset + n_bytes > len(self._mm):
                raise GGUFFormatError(f"tensor '{name}' runs past the end of the file ({n_bytes} bytes at "
                                      f"{start + offset}, file {len(self._mm)} bytes): truncated?")
            self.tensors.append(Tensor(self, name, dims, ttype, start + offset, n_bytes))

    def _value(self, key: str, vtype: int) -> Field:
        if vtype == _STRING:
            text = self._string()
            return Field(key, 1, lambda: text)
        if vtype in _SCALARS:
            value = self._read(_SCALARS[vtype])
            return Field(key, 1, lambda: value)
        if vtype != _ARRAY:
            raise GGUFFormatError(f"field '{key}' has unknown value type {vtype}")
        sub, count = self._read("<I"), self._read("<Q")
        first = self._off
        if sub == _STRING:  # skipped now, decoded on demand
            mm, off = self._mm, self._off
            for _ in range(count):
                off += 8 + int.from_bytes(mm[off:off + 8], "little")
            if off > len(mm):
                raise GGUFFormatError(f"field '{key}' runs past the end of the file")
            self._off = off
            return Field(key, count, lambda: self._strings(first, count))
        if sub not in _SCALARS:
            raise GGUFFormatError(f"field '{key}' is an array of value type {sub}, which this reader does not read")
        dtype = np.dtype(_SCALARS[sub])
        self._off += dtype.itemsize * count
        if self._off > len(self._mm):
            raise GGUFFormatError(f"field '{key}' runs past the end of the file")
        return Field(key, count, lambda: self.buffer[first:first + dtype.itemsize * count].view(dtype).tolist())

    def _strings(self, off: int, count: int) -> list[str]:
        out, mm = [], self._mm
        for _ in range(count):
            n = int.from_bytes(mm[off:off + 8], "little")
            out.append(mm[off + 8:off + 8 + n].decode("utf-8"))
            off += 8 + n
        return out

    def release(self, tensor: Tensor) -> None:
        """Drop the tensor's pages from this process's RSS (after its blocks were copied)."""
        self._release(tensor.offset, tensor.n_bytes)

    def release_view(self, view: np.ndarray) -> None:
        """The same for the bytes under `view`, when it is a contiguous view of the mapping
        (anything else, e.g. a permuted copy, is left alone)."""
        start = view.ctypes.data - self.buffer.ctypes.data
        if view.flags.c_contiguous and start >= 0 and start + view.nbytes <= len(self._mm):
            self._release(start, view.nbytes)

    def release_all(self) -> None:
        """Drop every page of the mapping from this process's RSS. Safe whatever is still read from
        it: the mapping is shared and read-only, so a page used again is faulted back in from the
        page cache, unchanged."""
        self._release(0, len(self._mm))

    def _release(self, offset: int, n_bytes: int) -> None:
        # Whole pages only: those shared with a neighbouring tensor go too, harmlessly (they are
        # file pages: read again from the page cache if that tensor is still to be copied).
        page = mmap.PAGESIZE
        lo = offset // page * page
        hi = min(len(self._mm), -(-(offset + n_bytes) // page) * page)
        if hi > lo:
            self._mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
