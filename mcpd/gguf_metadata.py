"""What a GGUF file's header says, taken out of the gguf package's reader once: every metadata
value, and each tensor's name, type, shape and place in the file. The reader spends seconds of
CPU on a real model's header (a numpy view per tokenizer string); this form is what each process
keeps, and what gguf_cache.py hands from the process that read the file to the others.

Tensor data is mapped from the file on first use, at the offsets the reader found, as the
reader's own views are shaped: a float type as its numbers, any other as bytes a row.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

from mcpd.bad_gguf import BadGGUF

# Tensor types the reader views as their numbers; it views every other type as bytes.
NUMBER_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                "I32": np.int32, "I64": np.int64}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]   # as GGUF lists it: the fastest dimension first
    data_offset: int         # from the start of the file

    @property
    def n_elements(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count

    @property
    def n_bytes(self) -> int:
        block, size = GGML_QUANT_SIZES[self.tensor_type]
        return self.n_elements * size // block


@dataclass
class GGUFMetadata:
    path: Path
    header_bytes: int                      # where tensor data starts: everything above is read from before it
    values: dict[str, object]              # key -> its contents (str, int, float, bool or a list of them)
    unreadable: dict[str, str]             # key -> why its value cannot be read
    tensors: list[TensorInfo]
    swapped: bool = False                  # its numbers in the other byte order than this machine's
    _map: np.memmap | None = field(default=None, repr=False)

    def value(self, key: str):
        """Metadata `key`'s contents; None where absent, BadGGUF where it cannot be read."""
        if key in self.unreadable:
            raise BadGGUF(f"{key}: unreadable ({self.unreadable[key]})")
        return self.values.get(key)

    def data(self, tensor: TensorInfo) -> np.ndarray:
        """`tensor`'s data, a read-only view of the file, shaped as the gguf reader shapes it."""
        if self._map is None:
            self._map = np.memmap(self.path, mode="r")
        raw = self._map[tensor.data_offset:tensor.data_offset + tensor.n_bytes]
        shape = tuple(reversed(tensor.shape))
        number = NUMBER_TYPES.get(tensor.tensor_type.name)
        if number is None:
            return raw.reshape(quant_shape_to_byte_shape(shape, tensor.tensor_type))
        dtype = np.dtype(number)
        return raw.view(dtype.newbyteorder("S") if self.swapped else dtype).reshape(shape)

def from_reader(reader, path: Path) -> GGUFMetadata:
    """The metadata the gguf package's GGUFReader `reader` read from `path`."""
    values, unreadable = {}, {}
    for key, got in reader.fields.items():
        try:
            values[key] = got.contents()
        except (ValueError, IndexError) as e:   # a string that is not UTF-8
            unreadable[key] = str(e)
    tensors = [TensorInfo(t.name, t.tensor_type, tuple(int(n) for n in t.shape), int(t.data_offset))
               for t in reader.tensors]
    return GGUFMetadata(path, int(reader.data_offset), values, unreadable, tensors, reader.byte_order == "S")
