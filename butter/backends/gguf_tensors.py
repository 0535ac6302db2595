"""Where a tensor's bytes are in a GGUF file, read straight from its header (pure).

The `gguf` package reads the same header, but it materializes every metadata value on
the way, which takes seconds for a large vocabulary (docs/design/kernels.md has the figures);
here values are skipped unless asked for. Format: github.com/ggml-org/ggml docs/gguf.md.
"""

from __future__ import annotations

import mmap
import struct
from collections.abc import Iterable
from pathlib import Path

import attrs

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
# Fixed-size value types: their struct format, and their size in bytes.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                   10: "<Q", 11: "<q", 12: "<d"}
_FIXED = {kind: struct.calcsize(fmt) for kind, fmt in _SCALAR_FORMATS.items()}
DEFAULT_ALIGNMENT = 32


class GgufFormatError(ValueError):
    """The file is not a GGUF this reader understands."""


@attrs.frozen
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # ggml order: shape[0] is the row length
    ggml_type: int
    offset: int  # from the start of the file


@attrs.frozen
class GgufHeader:
    metadata: dict[str, object]  # only the scalar and string values that were asked for
    keys: frozenset[str]  # every metadata key present
    tensors: dict[str, TensorInfo]


class _Cursor:
    def __init__(self, data: mmap.mmap) -> None:
        self.data, self.at = data, 0

    def unpack(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return int(value)

    def string(self) -> str:
        length = self.unpack("<Q")
        text = bytes(self.data[self.at : self.at + length]).decode("utf-8", errors="replace")
        self.at += length
        return text

    def skip_string(self) -> None:
        length = self.unpack("<Q")  # (not `self.at += ...`: unpack moves `at` first)
        self.at += length

    def value(self, kind: int, *, keep: bool) -> object:
        if kind == _STRING:
            if keep:
                return self.string()
            self.skip_string()
            return None
        if kind == _ARRAY:
            element, count = self.unpack("<I"), self.unpack("<Q")
            if element in _FIXED:
                self.at += _FIXED[element] * count
            else:
                for _ in range(count):
                    self.value(element, keep=False)
            return None
        if kind not in _SCALAR_FORMATS:
            raise GgufFormatError(f"unknown GGUF value type {kind}")
        if keep:
            (value,) = struct.unpack_from(_SCALAR_FORMATS[kind], self.data, self.at)
            self.at += _FIXED[kind]
            return value
        self.at += _FIXED[kind]
        return None


def read_header(path: Path, *, keys: Iterable[str] = ()) -> GgufHeader:
    """Tensor locations, which metadata keys exist, and the values of `keys`."""
    wanted = {"general.alignment", *keys}
    with path.open("rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        if data[:4] != _MAGIC:
            raise GgufFormatError(f"not a GGUF file: {path}")
        cursor = _Cursor(data)
        cursor.at = 4
        version = cursor.unpack("<I")
        if version < 2:
            raise GgufFormatError(f"GGUF version {version} is not supported")
        n_tensors, n_kv = cursor.unpack("<Q"), cursor.unpack("<Q")
        metadata: dict[str, object] = {}
        present: set[str] = set()
        for _ in range(n_kv):
            key = cursor.string()
            present.add(key)
            value = cursor.value(cursor.unpack("<I"), keep=key in wanted)
            if key in wanted:
                metadata[key] = value
        infos = []
        for _ in range(n_tensors):
            name = cursor.string()
            shape = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
            ggml_type, offset = cursor.unpack("<I"), cursor.unpack("<Q")
            infos.append((name, shape, ggml_type, offset))
        alignment = metadata.get("general.alignment")
        if not isinstance(alignment, int) or alignment <= 0:
            alignment = DEFAULT_ALIGNMENT
        start = -(-cursor.at // alignment) * alignment
    tensors = {
        name: TensorInfo(name, shape, ggml_type, start + offset)
        for name, shape, ggml_type, offset in infos
    }
    return GgufHeader(metadata=metadata, keys=frozenset(present), tensors=tensors)
