"""Sharded safetensors folders as the ecosystem writes large models: `model-0000i-of-0000N.safetensors` plus
`model.safetensors.index.json` (name -> file), or one `model.safetensors` when everything fits one file.

`ShardedWriter` takes tensors one at a time and holds at most one output file's worth before writing that
file; `SafetensorsFolder` reads either layout tensor by tensor, or by slices (`safe_open(...).get_slice`),
never the whole model at once.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from meshformer.checkpointing.errors import CorruptCheckpointError
from meshformer.config import parse_size  # one reader of sizes: config validation checks them with it
from meshformer.folders import inside

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_SIZE = "5GB"
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


class ShardedWriter:
    """Append tensors in order; a file is written (once, whole) as soon as the next tensor would overflow it."""

    def __init__(self, directory: Path, max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
                 metadata: dict[str, str] | None = None) -> None:
        self.directory = Path(directory)
        self.max_bytes = parse_size(max_shard_size)
        if self.max_bytes <= 0:
            raise ValueError(f"max shard size must be positive, got {max_shard_size!r}")
        self.metadata = metadata or {}
        self.directory.mkdir(parents=True, exist_ok=True)
        for stale in [*self.directory.glob("model-*-of-*.safetensors"), self.directory / SINGLE_FILE,
                      self.directory / INDEX_FILE]:  # a rewrite must not mix with an older layout
            stale.unlink(missing_ok=True)
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._files: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + size > self.max_bytes:
            self._flush()
        self._pending[name] = tensor.detach().to("cpu").contiguous()
        self._pending_bytes += size
        self.total_bytes += size

    def _flush(self) -> None:
        path = self.directory / f"model-{len(self._files) + 1:05d}.partial.safetensors"
        save_file(self._pending, str(path), metadata={"format": "pt", **self.metadata})
        self._files.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> Path:
        """Name the files (-of-N now that N is known) and write the index; returns the index or the one file."""
        if self._pending or not self._files:
            self._flush()
        if len(self._files) == 1:
            target = self.directory / SINGLE_FILE
            self._files[0][0].rename(target)
            return target
        weight_map = {}
        n = len(self._files)
        for i, (path, names) in enumerate(self._files, start=1):
            final = f"model-{i:05d}-of-{n:05d}.safetensors"
            path.rename(self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        index = self.directory / INDEX_FILE
        index.write_text(json.dumps({"metadata": {"total_size": self.total_bytes, **self.metadata},
                                     "weight_map": weight_map}, indent=2))
        return index


def has_safetensors(directory: Path) -> bool:
    directory = Path(directory)
    return (directory / SINGLE_FILE).is_file() or (directory / INDEX_FILE).is_file()


class SafetensorsFolder:
    """Tensors of a single-file or sharded safetensors folder, opened lazily, read one at a time."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        if (self.directory / SINGLE_FILE).is_file():
            self.source = self.directory / SINGLE_FILE  # the file naming the tensors: the one file or the index
            with safe_open(str(self.source), framework="pt") as f:
                self.weight_map = dict.fromkeys(f.keys(), SINGLE_FILE)
        elif (self.directory / INDEX_FILE).is_file():
            self.source = self.directory / INDEX_FILE
            self.weight_map = _read_index(self.source)
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


def _read_index(index: Path) -> dict[str, str]:
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
        inside(index.parent, file, what=str(index), fix=fix)
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
