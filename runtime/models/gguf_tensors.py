"""A GGUF file's tensor table, read without parsing its metadata values (issue 43: weights at disk speed).

gguf-py's GGUFReader builds a numpy object for every metadata value on open; a chat model's file carries its
whole tokenizer there (SmolLM2: 49k token strings, 48k merges), and parsing those took ~5 s of every start of
the default model on the shared 2-core Xeon -- longer than dequantising the weights. The loader needs only the
tensor table, so this walks the metadata by its lengths (a string array is one length read per item, no
objects), reads `general.alignment`, then the tensor infos, and gives each tensor the same read-only memory-map
view GGUFReader's ReaderTensor.data has (quantised types: uint8 rows of blocks; F32/F16/...: typed values).
The config and the tokenizer come from the prepared directory, which GGUFReader parsed once when it was written
(runtime/gguf_model_dir.py). Files this does not understand (not little-endian GGUF v2/v3) return None: the
caller falls back to GGUFReader.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32
# GGUF metadata value types -> their fixed size in bytes (8: string, 9: array are variable)
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY, _UINT32 = 8, 9, 4
_PLAIN = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16}
_PLAIN.update({"I32": np.int32, "I64": np.int64})


@dataclass(frozen=True)
class GGUFTensor:
    """What the loader reads of one tensor (the attributes of gguf's ReaderTensor it uses)."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # read-only view of the file


class _Cursor:
    def __init__(self, buf: memoryview):
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> tuple:
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return values

    def string(self) -> bytes:
        (length,) = self.unpack("<Q")
        value = bytes(self.buf[self.pos : self.pos + length])
        self.pos += length
        return value

    def skip_value(self, kind: int) -> None:
        if kind in _SCALAR_BYTES:
            self.pos += _SCALAR_BYTES[kind]
        elif kind == _STRING:
            (length,) = self.unpack("<Q")
            self.pos += length
        elif kind == _ARRAY:
            item_kind, count = self.unpack("<IQ")
            if item_kind in _SCALAR_BYTES:
                self.pos += _SCALAR_BYTES[item_kind] * count
            else:
                for _ in range(count):
                    self.skip_value(item_kind)
        else:
            raise ValueError(f"unknown GGUF value type {kind}")


def read_tensors(path: str) -> list[GGUFTensor] | None:
    """The file's tensors in file order, or None when it is not a little-endian GGUF v2/v3 file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    data = np.memmap(path, mode="r")
    cursor = _Cursor(memoryview(data))
    if bytes(data[:4]) != MAGIC:
        return None
    cursor.pos = 4
    (version,) = cursor.unpack("<I")
    if version not in (2, 3):
        return None
    num_tensors, num_fields = cursor.unpack("<QQ")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(num_fields):
        key = cursor.string()
        (kind,) = cursor.unpack("<I")
        if key == b"general.alignment" and kind == _UINT32:
            (alignment,) = cursor.unpack("<I")
        else:
            cursor.skip_value(kind)
    infos = []
    for _ in range(num_tensors):
        name = cursor.string().decode("utf-8")
        (n_dims,) = cursor.unpack("<I")
        dims = cursor.unpack(f"<{n_dims}Q")
        raw_type, offset = cursor.unpack("<IQ")
        infos.append((name, dims, GGMLQuantizationType(raw_type), offset))
    start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        shape = tuple(reversed(dims))  # GGUF lists the fastest-varying dimension first
        n_elements = int(np.prod(dims))
        block_size, type_size = GGML_QUANT_SIZES[kind]
        n_bytes = n_elements * type_size // block_size
        raw = data[start + offset : start + offset + n_bytes]
        if kind.name in _PLAIN:
            view = raw.view(_PLAIN[kind.name]).reshape(shape)
        else:  # quantised (and BF16): rows of bytes, as GGUFReader shapes them for gguf.quants.dequantize
            view = raw.reshape(*shape[:-1], shape[-1] // block_size * type_size)
        tensors.append(GGUFTensor(name, kind, np.asarray(view)))
    return tensors
