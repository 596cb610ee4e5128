"""A minimal reader of the safetensors format (header parsing, memory-mapped tensors).

Format: 8-byte little-endian header length ``n``, ``n`` bytes of JSON mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end
of the header; an optional ``__metadata__`` entry), then the data. Every malformation is a
``CheckpointError`` naming the file.
"""

from __future__ import annotations

import json
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from hicache.model.hf_config import CheckpointError

DTYPES: dict[str, tuple[torch.dtype, int]] = {
    "F32": (torch.float32, 4),
    "F16": (torch.float16, 2),
    "BF16": (torch.bfloat16, 2),
    "F64": (torch.float64, 8),
}
MAX_HEADER_BYTES = 100 * 2**20


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class SafetensorsFile:
    """One ``.safetensors`` file: parsed header, tensors read on demand (memory-mapped)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    raise CheckpointError(f"{self.path}: too short to be a safetensors file")
                (n,) = struct.unpack("<Q", head)
                if n > MAX_HEADER_BYTES:
                    raise CheckpointError(f"{self.path}: header length {n} is implausible (corrupt file?)")
                self.header_bytes = f.read(n)
                f.seek(0, 2)
                size = f.tell()
        except FileNotFoundError as exc:
            raise CheckpointError(f"weight file {self.path} is missing") from exc
        except OSError as exc:
            raise CheckpointError(f"cannot read weight file {self.path}: {exc}") from exc
        if len(self.header_bytes) != n:
            raise CheckpointError(f"{self.path}: truncated header")
        try:
            header = json.loads(self.header_bytes)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"{self.path}: header is not valid JSON: {exc}") from exc
        if not isinstance(header, dict):
            raise CheckpointError(f"{self.path}: header must be a JSON object")
        base = 8 + n
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = entry["dtype"]
                shape = tuple(int(x) for x in entry["shape"])
                begin, end = (int(x) for x in entry["data_offsets"])
            except (KeyError, TypeError, ValueError) as exc:
                raise CheckpointError(f"{self.path}: malformed header entry for {name!r}") from exc
            if dtype not in DTYPES:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} has dtype {dtype}, supported: {', '.join(DTYPES)}"
                )
            numel = 1
            for x in shape:
                numel *= x
            if end - begin != numel * DTYPES[dtype][1] or begin < 0 or base + end > size:
                raise CheckpointError(
                    f"{self.path}: tensor {name!r} data range [{begin}, {end}) does not match its "
                    f"shape {list(shape)} / dtype {dtype} or lies beyond the end of the file (truncated?)"
                )
            self.tensors[name] = TensorInfo(name, dtype, shape, base + begin, base + end)
        self._mmap: mmap.mmap | None = None

    def read(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """A fresh tensor (not backed by the file) converted to ``dtype``."""
        info = self.tensors[name]
        if self._mmap is None:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
        tdtype, width = DTYPES[info.dtype]
        count = (info.end - info.begin) // width
        if count == 0:
            return torch.empty(info.shape, dtype=dtype)
        raw = torch.frombuffer(self._mmap, dtype=tdtype, count=count, offset=info.begin)
        return raw.view(info.shape).to(dtype=dtype, copy=True)

    def sample(self, name: str, nbytes: int = 64) -> bytes:
        """Up to ``3 * nbytes`` bytes of the tensor's data (start, middle, end), for fingerprints."""
        info = self.tensors[name]
        size = info.end - info.begin
        out = []
        with open(self.path, "rb") as f:
            for off in sorted({0, max(0, size // 2 - nbytes // 2), max(0, size - nbytes)}):
                f.seek(info.begin + off)
                out.append(f.read(min(nbytes, size - off)))
        return b"".join(out)

    def close(self) -> None:
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
