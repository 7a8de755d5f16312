"""A fast reader for GGUF files: metadata, tensor directory and dequantized tensors.

The `gguf` package supplies the tensor-type constants and the dequantization kernels. Its
`GGUFReader` builds a numpy view for every element of every metadata array, which takes ~2.5 s for
SmolLM2's 49k-token vocabulary; this reader parses the same header with `struct` in tens of ms.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from tokenloop.errors import ModelLoadError, UnsupportedModelError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types -> struct format (scalars) ; 8 = string, 9 = array.
_SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
                   12: "<d"}
_NUMPY_TYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
                7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor lives in the file and how it is encoded."""

    name: str
    shape: tuple[int, ...]  # row-major (PyTorch) order: the last dimension is contiguous
    tensor_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    num_bytes: int


class GGUFFile:
    """An opened GGUF file. `metadata` maps keys to Python values (arrays as lists or numpy arrays)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as handle:
                self._map = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as exc:  # ValueError: mmap of an empty file
            raise ModelLoadError(f"{self.path}: cannot read GGUF file ({exc})") from exc
        self._pos = 0
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as exc:
            raise ModelLoadError(f"{self.path}: GGUF header is truncated or malformed ({exc})") from exc

    # -- header parsing -------------------------------------------------------------------------
    def _read(self, fmt: str) -> Any:
        value = struct.unpack_from(fmt, self._map, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return value

    def _read_string(self) -> str:
        return self._read_strings(1)[0]

    def _read_value(self, value_type: int) -> Any:
        if value_type in _SCALAR_FORMATS:
            return self._read(_SCALAR_FORMATS[value_type])
        if value_type == _STRING:
            return self._read_string()
        if value_type == _ARRAY:
            element_type = self._read("<I")
            count = self._read("<Q")
            if element_type in _NUMPY_TYPES:
                dtype = np.dtype(_NUMPY_TYPES[element_type]).newbyteorder("<")
                end = self._pos + count * dtype.itemsize
                if end > len(self._map):
                    raise struct.error("array runs past the end of the file")
                array = np.frombuffer(self._map, dtype=dtype, count=count, offset=self._pos).copy()
                self._pos = end
                return array
            if element_type == _STRING:
                return self._read_strings(count)
            return [self._read_value(element_type) for _ in range(count)]
        raise struct.error(f"unknown metadata value type {value_type}")

    def _read_strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary, its merges: ~100k here), read in one local loop (a method
        call per string took three times as long, and a server's start waits for it)."""
        data, pos, size = self._map, self._pos, len(self._map)
        length_at = struct.Struct("<Q").unpack_from
        strings = []
        for _ in range(count):
            (length,) = length_at(data, pos)
            pos += 8
            if pos + length > size:
                raise struct.error("string runs past the end of the file")
            strings.append(data[pos:pos + length].decode("utf-8", errors="replace"))
            pos += length
        self._pos = pos
        return strings

    def _parse(self) -> tuple[dict[str, Any], dict[str, GGUFTensorInfo]]:
        if self._map[:4] != GGUF_MAGIC:
            raise ModelLoadError(f"{self.path}: not a GGUF file (magic {bytes(self._map[:4])!r})")
        self._pos = 4
        version = self._read("<I")
        if version not in (2, 3):
            raise UnsupportedModelError(f"{self.path}: GGUF version {version} is not supported (2 or 3)")
        tensor_count = self._read("<Q")
        kv_count = self._read("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = self._read_string()
            metadata[key] = self._read_value(self._read("<I"))

        raw_infos = []
        for _ in range(tensor_count):
            name = self._read_string()
            n_dims = self._read("<I")
            dims = [self._read("<Q") for _ in range(n_dims)]
            type_id = self._read("<I")
            offset = self._read("<Q")
            raw_infos.append((name, dims, type_id, offset))

        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = (self._pos + alignment - 1) // alignment * alignment
        tensors: dict[str, GGUFTensorInfo] = {}
        for name, dims, type_id, offset in raw_infos:
            try:
                tensor_type = GGMLQuantizationType(type_id)
            except ValueError:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {name!r} has unknown GGML type id {type_id}") from None
            block_elems, block_bytes = GGML_QUANT_SIZES[tensor_type]
            num_elements = int(np.prod(dims)) if dims else 1
            if num_elements % block_elems:
                raise ModelLoadError(f"{self.path}: tensor {name!r} has {num_elements} elements, "
                                     f"not a multiple of its {tensor_type.name} block of {block_elems}")
            num_bytes = num_elements // block_elems * block_bytes
            start = data_start + offset
            if start + num_bytes > len(self._map):
                raise ModelLoadError(
                    f"{self.path}: file is truncated: tensor {name!r} needs bytes {start}..{start + num_bytes} "
                    f"but the file has {len(self._map)}")
            # GGUF lists dimensions innermost first; PyTorch wants them outermost first.
            tensors[name] = GGUFTensorInfo(name, tuple(reversed(dims)), tensor_type, start, num_bytes)
        return metadata, tensors

    # -- tensor data ----------------------------------------------------------------------------
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only uint8 view of the mapped file."""
        info = self.tensors[name]
        return np.frombuffer(self._map, dtype=np.uint8, count=info.num_bytes, offset=info.offset)

    def load(self, name: str) -> np.ndarray:
        """The tensor dequantized to float32, in its row-major shape."""
        info = self.tensors[name]
        data = self.raw(name)
        kind = info.tensor_type
        if kind == GGMLQuantizationType.F32:
            values = data.view(np.float32).copy()  # own the memory: the map is read-only
        elif kind == GGMLQuantizationType.F16:
            values = data.view(np.float16).astype(np.float32)
        else:
            rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
            try:
                values = dequantize(data.reshape(rows, -1), kind)
            except NotImplementedError as exc:
                raise UnsupportedModelError(
                    f"{self.path}: tensor {name!r} uses type {kind.name}, which cannot be dequantized") from exc
        return np.asarray(values, dtype=np.float32).reshape(info.shape)

    def close(self) -> None:
        self._map.close()
