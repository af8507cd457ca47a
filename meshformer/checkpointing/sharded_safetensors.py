"""Sharded safetensors folders as the ecosystem writes large models: `model-0000i-of-0000N.safetensors` plus
`model.safetensors.index.json` (name -> file), or one `model.safetensors` when everything fits one file.

`ShardedWriter` plans the files from the tensors' shapes, writes each header first and streams each tensor to
disk as it comes, holding none; `SafetensorsFolder` reads either layout tensor by tensor, or by slices
(`safe_open(...).get_slice`), never the whole model at once.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import BinaryIO

import torch
from safetensors import SafetensorError, safe_open

from meshformer.checkpointing.checkpoint_errors import CorruptCheckpointError
from meshformer.checkpointing.formats import DEFAULT_MAX_SHARD_SIZE, INDEX_FILE, SINGLE_FILE
from meshformer.checkpointing.manifest import fsync_dir
from meshformer.config import parse_size  # one reader of sizes: config validation checks them with it
from meshformer.folders import inside

_LINK_FIX = "copy the linked file into the folder (cp -L), or point at the folder that holds it"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


class ShardedWriter:
    """Stream tensors into safetensors files: the files are planned from `layout` (name -> tensor of the shape
    and dtype to come, e.g. on the meta device; in writing order), each file's header is written first and each
    tensor goes to disk as it is added, so the writer holds no tensor. A file is split off as soon as the next
    tensor would overflow `max_shard_size`.

    Files are written under `<name>.partial` names and renamed, fsynced, when `close` has every tensor: a folder
    left by a kill holds no `model.safetensors` or index, and every reader refuses it.
    """

    def __init__(self, directory: Path, layout: Mapping[str, torch.Tensor],
                 max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE, metadata: dict[str, str] | None = None) -> None:
        self.directory = Path(directory)
        self.max_bytes = parse_size(max_shard_size)
        if self.max_bytes <= 0:
            raise ValueError(f"max shard size must be positive, got {max_shard_size!r}")
        self.metadata = {"format": "pt", **(metadata or {})}
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in [*self.directory.glob("model-*-of-*.safetensors*"), *self.directory.glob(SINGLE_FILE + "*"),
                      self.directory / INDEX_FILE]:  # a rewrite must not mix with an older layout
            stale.unlink(missing_ok=True)
        self._layout = {name: (tuple(t.shape), t.dtype) for name, t in layout.items()}
        self._files = _plan_files(self._layout, self.max_bytes)
        n = len(self._files)
        self._names = [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        self._order = iter([name for names in self._files for name in names])
        self._file_of = {name: i for i, names in enumerate(self._files) for name in names}
        self._file_index = -1
        self._out: BinaryIO | None = None
        self._current: str | None = None  # the tensor being written, and its bytes still to come
        self._remaining = 0
        self.total_bytes = sum(_nbytes(*entry) for entry in self._layout.values())

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """The whole tensor `name`, the next one in the layout's order."""
        if tuple(tensor.shape) != self._layout.get(name, (None,))[0]:
            raise ValueError(f"{name!r} has the shape {tuple(tensor.shape)}, the layout {self._layout.get(name)}")
        self.add_part(name, tensor)

    def add_part(self, name: str, piece: torch.Tensor) -> None:
        """The next piece of `name` (pieces along dim 0, in order, make the tensor): a tensor can be written as
        its shards arrive, without ever being whole in memory."""
        if self._current is None:
            expected = next(self._order, None)
            if name != expected:
                raise ValueError(f"the writer expected {expected!r} next, got {name!r}")
            if self._file_of[name] != self._file_index:
                self._next_file()
            self._current, self._remaining = name, _nbytes(*self._layout[name])
        data = piece.detach().contiguous().reshape(-1)
        size = data.numel() * data.element_size()
        if name != self._current or piece.dtype != self._layout[name][1] or size > self._remaining:
            raise ValueError(f"{name!r} {piece.dtype} ({size} bytes) does not continue {self._current!r} "
                             f"{self._layout[self._current][1]} ({self._remaining} bytes to go)")
        assert self._out is not None  # opened with the tensor's first piece
        if size:  # raw little-endian bytes, without a copy on the CPU
            self._out.write(data.to("cpu").view(torch.uint8).numpy().data)
        self._remaining -= size
        if self._remaining == 0:
            self._current = None

    def _next_file(self) -> None:
        self._finish_file()
        self._file_index += 1
        header: dict[str, object] = {"__metadata__": self.metadata}
        offset = 0
        for name in self._files[self._file_index]:
            shape, dtype = self._layout[name]
            size = _nbytes(shape, dtype)
            header[name] = {"dtype": _DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self._out = open(self._partial(self._file_index), "wb")
        self._out.write(struct.pack("<Q", len(encoded)) + encoded)

    def _partial(self, index: int) -> Path:
        return self.directory / (self._names[index] + ".partial")

    def _finish_file(self) -> None:
        if self._out is not None:
            self._out.flush()
            os.fsync(self._out.fileno())
            self._out.close()
            self._out = None

    def close(self) -> Path:
        """Rename the complete files into place and write the index; returns the index or the one file."""
        if (missing := self._current or next(self._order, None)) is not None:
            raise ValueError(f"the writer was closed before {missing!r} was written whole")
        if not self._files[0]:  # nothing to write: still a valid, empty file
            self._next_file()
        self._finish_file()
        for i, name in enumerate(self._names):
            self._partial(i).rename(self.directory / name)
        if len(self._names) > 1:
            weight_map = {name: self._names[i] for i, names in enumerate(self._files) for name in names}
            _write_synced(self.directory / INDEX_FILE, json.dumps(
                {"metadata": {"total_size": self.total_bytes, **self.metadata}, "weight_map": weight_map}, indent=2))
        fsync_dir(self.directory)
        return self.directory / (INDEX_FILE if len(self._names) > 1 else SINGLE_FILE)


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * dtype.itemsize


def _plan_files(layout: Mapping[str, tuple[tuple[int, ...], torch.dtype]], max_bytes: int) -> list[list[str]]:
    """Tensor names per file, in order: a new file starts when the next tensor would overflow `max_bytes`."""
    files: list[list[str]] = [[]]
    used = 0
    for name, (shape, dtype) in layout.items():
        size = _nbytes(shape, dtype)
        if files[-1] and used + size > max_bytes:
            files.append([])
            used = 0
        files[-1].append(name)
        used += size
    return files


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def has_safetensors(directory: Path) -> bool:
    directory = Path(directory)
    return (directory / SINGLE_FILE).is_file() or (directory / INDEX_FILE).is_file()


class SafetensorsFolder:
    """Tensors of a single-file or sharded safetensors folder, opened lazily, read one at a time."""

    def __init__(self, directory: Path, follow_links: bool = False) -> None:
        self.directory = Path(directory)
        if (self.directory / SINGLE_FILE).is_file():
            inside(self.directory, SINGLE_FILE, what=str(self.directory), fix=_LINK_FIX, follow_links=follow_links)
            self.source = self.directory / SINGLE_FILE  # the file naming the tensors: the one file or the index
            try:
                with safe_open(str(self.source), framework="pt") as f:
                    self.weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
                    self.metadata: dict[str, str] = f.metadata() or {}
            except SafetensorError as err:  # a truncated file, or a header whose lengths or offsets lie
                raise CorruptCheckpointError(f"{self.source} is not a readable safetensors file ({err})",
                                             "copy or download it again whole, or re-export the folder") from None
        elif (self.directory / INDEX_FILE).is_file():
            self.source = self.directory / INDEX_FILE
            self.weight_map = _read_index(self.source, follow_links)
            self.metadata = {}
            for file in sorted(set(self.weight_map.values()))[:1]:  # every file carries the same metadata
                with safe_open(str(self.directory / file), framework="pt") as f:
                    self.metadata = f.metadata() or {}
        else:
            raise FileNotFoundError(f"{self.directory} holds neither {SINGLE_FILE} nor {INDEX_FILE}")
        self._open: tuple[str, object] | None = None

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def _handle(self, name: str):
        """The file holding `name`, opened on demand. Only one is kept open: an open file is memory-mapped, and
        the pages read from it would count towards this process's memory until it is closed."""
        file = self.weight_map[name]
        if self._open is None or self._open[0] != file:
            self._open = (file, safe_open(str(self.directory / file), framework="pt"))
        return self._open[1]

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)

    def meta(self, name: str) -> torch.Tensor:
        """Shape and dtype from the file header, as a meta tensor (no data read)."""
        view = self.get_slice(name)
        return torch.empty(view.get_shape(), dtype=_DTYPES[view.get_dtype()], device="meta")

    def get_slice(self, name: str):
        """A lazy view: index it (`[a:b]`, `[:, c:d]`) to read only those bytes."""
        return self._handle(name).get_slice(name)

    def items(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.weight_map:
            yield name, self.get(name)


def _read_index(index: Path, follow_links: bool = False) -> dict[str, str]:
    """The index's tensor -> file map, checked before any tensor is read: every file lies inside the folder and
    exists, and holds the tensors the index assigns to it."""
    fix = "re-export the folder, or copy it again whole (every model-*-of-*.safetensors file and the index)"
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise CorruptCheckpointError(f"{index} is not a safetensors index ({err!r})", fix) from None
    if not isinstance(weight_map, dict):
        raise CorruptCheckpointError(f"{index}: weight_map is not a mapping of tensor names to files", fix)
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        inside(index.parent, file, what=str(index), fix=fix, follow_links=follow_links)
        by_file.setdefault(file, []).append(name)
    missing = sorted(file for file in by_file if not (index.parent / file).is_file())
    if missing:
        raise FileNotFoundError(f"{index} lists {missing[:3]}, which are missing; copy every "
                                "model-*-of-*.safetensors file of the folder")
    for file, names in by_file.items():
        try:
            with safe_open(str(index.parent / file), framework="pt") as f:
                held = set(f.keys())
        except SafetensorError as err:
            raise CorruptCheckpointError(f"{index.parent / file} is not a readable safetensors file ({err})",
                                         fix) from None
        if lacking := [name for name in names if name not in held]:
            raise CorruptCheckpointError(f"{index} puts the tensor {lacking[0]!r} in {index.parent / file}, which "
                                         f"does not hold it{f' (nor {len(lacking) - 1} more)' if lacking[1:] else ''}",
                                         fix)
    return weight_map
