"""torch.distributed.checkpoint (DCP) reading without arbitrary pickles.

DCP stores its index (`.metadata`) with plain `pickle` and loads non-tensor entries with
`torch.load(weights_only=False)`. Both could run code from a crafted checkpoint, so loads go through
`SafeFileSystemReader` (an unpickler that only rebuilds DCP's own metadata classes) and `SafeLoadPlanner`
(non-tensor entries with `weights_only=True`). Tensors are already read with `weights_only=True` by DCP.
"""

from __future__ import annotations

import dataclasses
import io
import pathlib
import pickle
import warnings
from collections import OrderedDict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint import planner as dcp_planner
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from meshformer.checkpointing.checkpoint_errors import CheckpointError
from meshformer.folders import inside

METADATA_FILE = ".metadata"

_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("collections", "OrderedDict"): OrderedDict,
    ("pathlib", "PosixPath"): pathlib.PosixPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,  # a name only: nothing here touches that filesystem
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
}
# Megatron-Core keeps every rank's save plan in its metadata.
for _name in ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"):
    if hasattr(dcp_planner, _name):
        _ALLOWED[("torch.distributed.checkpoint.planner", _name)] = getattr(dcp_planner, _name)
for _name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
              "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"):
    if hasattr(dcp_metadata, _name):
        _ALLOWED[("torch.distributed.checkpoint.metadata", _name)] = getattr(dcp_metadata, _name)


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if module == "builtins" and name in ("set", "frozenset", "slice", "complex"):
            return {"set": set, "frozenset": frozenset, "slice": slice, "complex": complex}[name]
        raise pickle.UnpicklingError(
            f"DCP metadata refers to {module}.{name}, which is not part of DCP's metadata format; refusing to "
            "unpickle it (a checkpoint from an untrusted source, or a newer torch: report it if you trust the file)")


def read_metadata(path: Path, name: str = METADATA_FILE) -> dcp_metadata.Metadata:
    """The DCP index of a checkpoint folder, unpickled with an allowlist of DCP classes."""
    file = Path(path) / name
    if not file.is_file():
        raise CheckpointError(f"{path} holds no {METADATA_FILE}: not a torch.distributed.checkpoint folder")
    try:
        metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as err:
        raise CheckpointError(f"cannot read {file}: {err}") from None
    if not isinstance(metadata, dcp_metadata.Metadata):
        raise CheckpointError(f"{file} does not hold DCP metadata")
    for info in (metadata.storage_data or {}).values():  # DCP would open an absolute or `../` path as given
        inside(Path(path), getattr(info, "relative_path", None), what=str(file),
               fix="copy the checkpoint folder again whole from where it was written")
    return metadata


class SafeFileSystemReader(dcp.FileSystemReader):
    def __init__(self, path: str | Path, metadata: dcp_metadata.Metadata | None = None) -> None:
        """metadata: the folder's index when the caller has already read it (it is then not read again)."""
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> dcp_metadata.Metadata:
        rank = kwargs.get("rank")
        if rank is None and self._metadata is not None:
            metadata = self._metadata
        else:
            metadata = read_metadata(Path(self.path), METADATA_FILE if rank is None else f"__{rank}{METADATA_FILE}")
        storage_meta = getattr(metadata, "storage_meta", None) or dcp_metadata.StorageMeta()  # older files lack it
        storage_meta.load_id = self.load_id
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor entries are read with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        obj = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj


def tensor_entries(metadata: dcp_metadata.Metadata) -> dict[str, dcp_metadata.TensorStorageMetadata]:
    return {k: v for k, v in metadata.state_dict_metadata.items()
            if isinstance(v, dcp_metadata.TensorStorageMetadata)}


def load_in_place(state: dict[str, Any], path: Path, *, no_dist: bool = False,
                  process_group: torch.distributed.ProcessGroup | None = None,
                  metadata: dcp_metadata.Metadata | None = None) -> None:
    """Fill `state` (flat keys -> tensors/DTensors of the current layout) from a DCP folder; reshards.
    metadata: the folder's index, if already read."""
    dcp.load(state, storage_reader=SafeFileSystemReader(path, metadata), planner=SafeLoadPlanner(), no_dist=no_dist,
             process_group=process_group)


def read_full_tensors(path: Path, keys: list[str] | None = None,
                      metadata: dcp_metadata.Metadata | None = None) -> dict[str, torch.Tensor]:
    """Whole (unsharded) CPU tensors from a DCP folder in this one process, without a process group.
    metadata: the folder's index, if already read (a caller reading tensor by tensor reads it once)."""
    if metadata is None:
        metadata = read_metadata(path)
    entries = tensor_entries(metadata)
    wanted = list(entries) if keys is None else keys
    missing = [k for k in wanted if k not in entries]
    if missing:
        raise CheckpointError(f"{path} has no tensors named {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    state = {k: torch.empty(entries[k].size, dtype=entries[k].properties.dtype) for k in wanted}
    if state:
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            load_in_place(state, path, no_dist=True, metadata=metadata)
    return state


class _BoxLoadPlanner(SafeLoadPlanner):
    """Reads one box (offsets + the target's shape) of a saved tensor: only the saved chunks that overlap it."""

    def __init__(self, key: str, offsets: tuple[int, ...], target: torch.Tensor) -> None:
        super().__init__()
        self._key, self._offsets, self._target = key, offsets, target

    def create_local_plan(self) -> LoadPlan:
        assert self.metadata is not None  # set by set_up_planner
        entry = self.metadata.state_dict_metadata[self._key]
        assert isinstance(entry, dcp_metadata.TensorStorageMetadata)  # read_box checked it
        box = dcp_metadata.ChunkStorageMetadata(offsets=torch.Size(self._offsets), sizes=self._target.shape)
        return LoadPlan(create_read_items_for_chunk_list(self._key, entry, [box]))

    def lookup_tensor(self, index: dcp_metadata.MetadataIndex) -> torch.Tensor:
        return self._target  # the read items' offsets are relative to the box


def read_box(path: Path, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
    """The part [offsets, offsets + sizes) of one saved tensor, as a CPU tensor, without a process group.

    Only the saved chunks overlapping it are read (Megatron saves one chunk per layer and tensor-parallel
    part); a chunk is read whole, so a tensor saved as one chunk is read whole each time."""
    entries = tensor_entries(read_metadata(path))
    if key not in entries:
        raise CheckpointError(f"{path} has no tensor named {key}")
    size = tuple(entries[key].size)
    if len(offsets) != len(size) or any(o < 0 or o + n > s for o, n, s in zip(offsets, sizes, size, strict=True)):
        raise CheckpointError(f"{path}: {key} is {list(size)}; cannot read [{offsets}, +{sizes})")
    target = torch.empty(sizes, dtype=entries[key].properties.dtype)
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load({key: target}, storage_reader=SafeFileSystemReader(path),
                 planner=_BoxLoadPlanner(key, tuple(offsets), target), no_dist=True)
    return target


def save_tensors(state: Mapping[str, object], path: Path) -> None:
    """Write whole tensors (and DCP's plain objects) as a DCP folder from this one process (conversions, tests)."""
    Path(path).mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


class _StreamingSavePlanner(DefaultSavePlanner):
    """Plans from meta templates; each tensor's data is read only when the writer comes to it. Tensors named in
    `read_row` are written one chunk per index of their first dimension (as Megatron saves stacked layers)."""

    def __init__(self, read: Callable[[str], torch.Tensor],
                 read_row: Mapping[str, Callable[[int], torch.Tensor]] | None = None) -> None:
        super().__init__()
        self._read, self._read_row = read, read_row or {}

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items: list[WriteItem] = []
        for item in plan.items:
            if item.index.fqn not in self._read_row or item.tensor_data is None:
                items.append(item)
                continue
            size = item.tensor_data.size
            for row in range(size[0]):
                offsets = torch.Size([row] + [0] * (len(size) - 1))
                chunk = dcp_metadata.ChunkStorageMetadata(offsets=offsets, sizes=torch.Size([1, *size[1:]]))
                items.append(WriteItem(index=dcp_metadata.MetadataIndex(item.index.fqn, offsets),
                                       type=WriteItemType.SHARD,
                                       tensor_data=dataclasses.replace(item.tensor_data, chunk=chunk)))
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem) -> torch.Tensor | io.BytesIO:
        if write_item.type == WriteItemType.BYTE_IO:
            return super().resolve_data(write_item)
        fqn = write_item.index.fqn
        if fqn in self._read_row:
            assert write_item.index.offset is not None  # set per row by create_local_plan
            return self._read_row[fqn](write_item.index.offset[0]).unsqueeze(0).contiguous()
        return self._read(fqn).contiguous()


def save_tensors_streamed(templates: Mapping[str, object], read: Callable[[str], torch.Tensor], path: Path,
                          read_row: Mapping[str, Callable[[int], torch.Tensor]] | None = None) -> None:
    """Write a DCP folder from this one process holding one tensor (or row) at a time: `templates` (meta tensors,
    or DCP's plain objects) give shapes and dtypes, `read(name)` the data when it is written, and `read_row[name](i)`
    row i of a tensor written one chunk per row."""
    Path(path).mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.save(dict(templates), storage_writer=dcp.FileSystemWriter(str(path)),
                 planner=_StreamingSavePlanner(read, read_row), no_dist=True)
