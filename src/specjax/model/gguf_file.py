"""A GGUF file's metadata and tensor index, parsed with struct (the `gguf` package's reader spends ~3 s on a
49k-token vocabulary, building a numpy view per string); tensor bytes stay memory-mapped.

Format (little-endian, versions 2 and 3): magic, version, tensor count, metadata count; metadata as (key, type,
value); tensor infos as (name, dims, ggml type, offset); data after padding to `general.alignment`.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

MAGIC = b"GGUF"
STRING, ARRAY = 8, 9
SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
PLAIN_TENSORS = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                 "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # numpy order (the file lists dims innermost first)
    data: np.ndarray  # memory-mapped: elements for plain types, bytes per row for quantized ones


class GGUFFile:
    """`fields`: {key: int | float | bool | str | list}; `tensors`: [GGUFTensor] in file order.  Raises ValueError
    naming the problem for a file that is not a (little-endian, v2/v3) GGUF or is cut short."""

    def __init__(self, path: str):
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.path = path
        self.mm = np.memmap(path, mode="r")
        self.buf = memoryview(self.mm)
        self.pos = 0
        if bytes(self.buf[:4]) != MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        self.pos = 4
        version, tensor_count, kv_count = self._unpack("<IQQ")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2, 3; big-endian files are not supported)")
        self.fields = {}
        for _ in range(kv_count):
            key = self._string()
            (kind,) = self._unpack("<I")
            self.fields[key] = self._value(kind)
        infos = []
        for _ in range(tensor_count):
            name = self._string()
            (n_dims,) = self._unpack("<I")
            dims = self._unpack(f"<{n_dims}Q")
            kind, offset = self._unpack("<IQ")
            infos.append((name, tuple(reversed(dims)), GGMLQuantizationType(kind), offset))
        align = int(self.fields.get("general.alignment", 32))
        if align <= 0 or align & (align - 1):
            raise ValueError(f"invalid general.alignment {align}")
        start = -(-self.pos // align) * align
        self.tensors = []
        for name, shape, kind, offset in infos:
            n = int(np.prod(shape))
            plain = PLAIN_TENSORS.get(kind.name)
            block, type_size = GGML_QUANT_SIZES[kind]
            nbytes = n * type_size // block
            lo = start + offset
            if lo + nbytes > len(self.mm):
                raise ValueError(f"tensor {name} ends past the end of the file (truncated?)")
            # Plain ndarray views of the mapping (a np.memmap subclass makes gguf's dequantize ~1.6x slower).
            raw = np.asarray(self.mm[lo:lo + nbytes])
            if plain is not None:
                data = raw.view(plain).reshape(shape)
            else:
                data = raw.reshape(quant_shape_to_byte_shape(shape, kind))
            self.tensors.append(GGUFTensor(name, kind, shape, data))

    def _unpack(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError("file ends inside its metadata (truncated?)")
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return out

    def _string(self) -> str:
        return self._strings(1)[0]

    def _strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary: ~100k for SmolLM2), with the per-string work inlined."""
        length = struct.Struct("<Q").unpack_from
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        for _ in range(count):
            if pos + 8 > end:
                raise ValueError("file ends inside its metadata (truncated?)")
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > end:
                raise ValueError("file ends inside its metadata (truncated?)")
            out.append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def _value(self, kind: int):
        if kind == STRING:
            return self._string()
        if kind == ARRAY:
            elem, count = self._unpack("<IQ")
            if elem == STRING:
                return self._strings(count)
            if elem in SCALARS:
                dtype = np.dtype(SCALARS[elem])
                if self.pos + count * dtype.itemsize > len(self.buf):
                    raise ValueError("file ends inside its metadata (truncated?)")
                arr = np.frombuffer(self.buf, dtype, count, self.pos)
                self.pos += count * dtype.itemsize
                return arr.tolist()
            return [self._value(elem) for _ in range(count)]
        if kind in SCALARS:
            return self._unpack(SCALARS[kind])[0]
        raise ValueError(f"unknown GGUF metadata type {kind}")


def _scales(blocks: np.ndarray, start: int, count: int = 1) -> np.ndarray:
    """float16 fields at byte `start` of each block -> float32 [blocks, count]."""
    return np.ascontiguousarray(blocks[:, start:start + 2 * count]).view(np.float16).astype(np.float32)


def _q4_0(b: np.ndarray, out: np.ndarray) -> None:  # block: d (f16), 16 bytes of nibbles; x = (q - 8) * d
    np.bitwise_and(b[:, 2:], 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(b[:, 2:], 4, out=out[:, 16:], casting="unsafe")
    out -= 8.0
    out *= _scales(b, 0)


def _q4_1(b: np.ndarray, out: np.ndarray) -> None:  # block: d, m (f16), 16 bytes of nibbles; x = q * d + m
    np.bitwise_and(b[:, 4:], 0x0F, out=out[:, :16], casting="unsafe")
    np.right_shift(b[:, 4:], 4, out=out[:, 16:], casting="unsafe")
    dm = _scales(b, 0, 2)
    out *= dm[:, :1]
    out += dm[:, 1:]


def _q8_0(b: np.ndarray, out: np.ndarray) -> None:  # block: d (f16), 32 int8; x = q * d
    out[:] = b[:, 2:].view(np.int8)
    out *= _scales(b, 0)


# ggml type name -> (bytes per block of 32 weights, dequantize one [blocks, bytes] array into [blocks, 32])
BLOCK_DEQUANT = {"Q4_0": (18, _q4_0), "Q4_1": (20, _q4_1), "Q8_0": (34, _q8_0)}


def gguf_field(reader: GGUFFile, key: str, default=None):
    """Scalar, string or list value of a GGUF metadata key (default when absent)."""
    return reader.fields.get(key, default)


def dequantize(data: np.ndarray, tensor_type) -> np.ndarray:
    """A tensor's weights as a new float32 array: whole-array numpy for the block formats of BLOCK_DEQUANT (the
    `gguf` package loops over row groups: ~3x slower on SmolLM2's Q4_1 weights) and plain types, the `gguf`
    package for the others.  Same values as `gguf.quants.dequantize`, bit for bit (tests/model)."""
    name = tensor_type.name
    if name in BLOCK_DEQUANT:
        size, fill = BLOCK_DEQUANT[name]
        blocks = np.asarray(data).reshape(-1, size)
        out = np.empty((blocks.shape[0], 32), np.float32)
        fill(blocks, out)
        return out.reshape(*data.shape[:-1], data.shape[-1] // size * 32)
    if name in PLAIN_TENSORS:
        return np.array(data, dtype=np.float32)
    import gguf

    return np.array(gguf.quants.dequantize(data, tensor_type), dtype=np.float32)
