"""Per-shard record index and ranged reads: a rank reads only the records it will use.

Every shard `NAME.tar` gets a sidecar `NAME.idx`: one fixed-size entry per record (the record's byte span
in the tar, from its first member header to the end of its last member's padding, and a 128-bit BLAKE2b
digest of that span). Spans tile the tar, so a run of consecutive records is one contiguous byte range.

A reader that wants some records of a shard reads their index entries (entry i sits at byte 32 i) and
then just their spans, coalescing neighbours into one read; every span is checked against its digest and
its tar member names against the record number before any sample is used. The shard's whole-file sha256
(manifest) is checked whenever a whole shard is streamed instead: `pipe:` and http(s) URLs (no seeking),
shards without an index (older manifests), and readers that want every record anyway.

Either way every tar member is checked by type and name as it is read (`shard_records`): a shard is data, so
it holds only regular files named `<record>.<key>.<u16|u32>` with the keys of its record type; a link, device,
folder, absolute or `..` name, or an unexpected key is refused by name, never skipped or looked up blindly.
"""

from __future__ import annotations

import hashlib
import io
import os
import re
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import numpy as np

ENTRY = np.dtype([("offset", "<u8"), ("length", "<u8"), ("digest", "V16")])
_STREAM_ONLY = ("pipe:", "http://", "https://")
RECORD_KEYS = {"packed": ("tokens",), "pairs": ("src", "tgt")}  # the members of one record, by record type
_MEMBER_NAME = re.compile(r"(\d{9})\.([a-z]+)\.(u16|u32)")


class MemberError(ValueError):
    """A tar member that a prepared shard cannot hold (the message names it and says why)."""


def dtype_ext(np_dtype: np.dtype) -> str:
    return {2: "u16", 4: "u32"}[np.dtype(np_dtype).itemsize]


def _member_kind(member: tarfile.TarInfo) -> str:
    kinds = [(member.issym(), "symbolic link"), (member.islnk(), "hard link"), (member.isdir(), "folder"),
             (member.isdev(), "device or pipe")]
    return next((name for found, name in kinds if found), "special file")


def _tar_members(fileobj: IO[bytes], ext: str) -> Iterator[tuple[str, str, bytes]]:
    """(record key, member key, bytes) of each member of a shard's tar stream, each checked first: a regular
    file named `<9-digit record>.<key>.<ext>`; anything else raises MemberError naming it."""
    with tarfile.open(fileobj=fileobj, mode="r|") as tar:
        for member in tar:
            name = member.name
            if not member.isreg():
                raise MemberError(f"member {name!r} is a {_member_kind(member)}, not a regular file")
            if name.startswith("/") or ".." in name.split("/"):
                raise MemberError(f"member {name!r} names a path outside the shard")
            match = _MEMBER_NAME.fullmatch(name)
            if match is None or match[3] != ext:
                raise MemberError(f"member {name!r} is not named <record>.<key>.{ext}")
            data = tar.extractfile(member)
            assert data is not None  # a regular file always has data
            yield match[1], match[2], data.read()
            tar.members = []  # type: ignore[attr-defined]  # a stream of any length: keep no TarInfo list


def shard_records(fileobj: IO[bytes], np_dtype: np.dtype, record_type: str | None, first: int = 0
                  ) -> Iterator[tuple[int, dict[str, np.ndarray]]]:
    """(record number, {key: tokens}) of each record in a shard's tar stream, numbered from `first`, after checking
    each member (`_tar_members`), that records come in order, and that each holds exactly the keys of `record_type`
    ("packed" or "pairs"; None: either). MemberError names the first member or record that breaks a rule."""
    expected = [RECORD_KEYS[record_type]] if record_type else list(RECORD_KEYS.values())
    record = first
    arrays: dict[str, np.ndarray] = {}
    for key, part, data in _tar_members(fileobj, dtype_ext(np_dtype)):
        if arrays and key != f"{record:09d}":
            yield record, _complete(record, arrays, expected)
            record, arrays = record + 1, {}
        if key != f"{record:09d}" or part in arrays:
            raise MemberError(f"member '{key}.{part}.{dtype_ext(np_dtype)}' found where record {record:09d} belongs")
        arrays[part] = np.frombuffer(data, dtype=np_dtype)
    if arrays:
        yield record, _complete(record, arrays, expected)


def _complete(record: int, arrays: dict[str, np.ndarray], expected: list[tuple[str, ...]]) -> dict[str, np.ndarray]:
    if tuple(sorted(arrays)) not in [tuple(sorted(keys)) for keys in expected]:
        raise MemberError(f"record {record:09d} holds the keys {sorted(arrays)}, not "
                          f"{' or '.join(str(list(keys)) for keys in expected)}")
    return arrays


def index_name(shard_name: str) -> str:
    return shard_name[:-4] + ".idx" if shard_name.endswith(".tar") else shard_name + ".idx"


def build_index(tar_bytes: bytes, spans: list[tuple[int, int]]) -> bytes:
    """The index of one written shard from its samples' (start, end) byte spans."""
    entries = np.zeros(len(spans), dtype=ENTRY)
    for i, (start, end) in enumerate(spans):
        entries[i] = (start, end - start, _digest(tar_bytes[start:end]))
    return entries.tobytes()


def _digest(span: bytes) -> bytes:
    return hashlib.blake2b(span, digest_size=16).digest()


def seekable(url: str) -> bool:
    """Local paths and fsspec object stores allow range reads; pipes and plain http(s) are streamed."""
    return not url.startswith(_STREAM_ONLY)


class RangeReader:
    """Reads byte ranges of one local file or fsspec object, counting the bytes read."""

    def __init__(self, url: str) -> None:
        self.url, self.nbytes = url, 0
        local = "://" not in url or url.startswith("file://")
        self._path = url[len("file://"):] if url.startswith("file://") else url
        self._fd = os.open(self._path, os.O_RDONLY) if local else None
        if self._fd is None:
            import fsspec

            self._fs, self._path = fsspec.core.url_to_fs(url)

    def size(self) -> int:
        return os.fstat(self._fd).st_size if self._fd is not None else int(self._fs.size(self._path))

    def read(self, runs: list[tuple[int, int]]) -> list[bytes]:
        """Bytes of each (start, end) run; short reads come back short (the caller checks)."""
        if self._fd is not None:
            out = [os.pread(self._fd, end - start, start) for start, end in runs]
        else:  # one batched request for all runs (object stores fetch them concurrently)
            out = self._fs.cat_ranges([self._path] * len(runs), [s for s, _ in runs], [e for _, e in runs])
        self.nbytes += sum(len(b) for b in out)
        return out

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _runs(sorted_ids: np.ndarray) -> list[tuple[int, int]]:
    """Consecutive integers -> [(first, last + 1), ...]."""
    if not len(sorted_ids):
        return []
    breaks = np.flatnonzero(np.diff(sorted_ids) != 1) + 1
    return [(int(run[0]), int(run[-1]) + 1) for run in np.split(sorted_ids, breaks)]


def read_records(url: str, index_url: str, samples: int, np_dtype: np.dtype, wanted: np.ndarray,
                 counter: Any = None, record_type: str | None = None) -> dict[int, dict[str, np.ndarray]]:
    """Records `wanted` (indices within the shard) by ranged reads; raises ValueError on any mismatch (MemberError:
    a member that breaks the rules of `shard_records`, whose `record_type` this is).

    counter: an object with an `nbytes` attribute to which the bytes read are added (read-volume stats).
    """
    wanted = np.unique(np.asarray(wanted, dtype=np.int64))
    if len(wanted) and (wanted[0] < 0 or wanted[-1] >= samples):
        raise ValueError(f"record {int(wanted[-1])} out of range for {samples} samples")
    index, data = RangeReader(index_url), RangeReader(url)
    try:
        entries_in_file = index.size() // ENTRY.itemsize
        if entries_in_file != samples:
            raise ValueError(f"{entries_in_file} samples read, manifest says {samples}")
        record_runs = _runs(wanted)
        raw = index.read([(a * ENTRY.itemsize, b * ENTRY.itemsize) for a, b in record_runs])
        entries = np.frombuffer(b"".join(raw), dtype=ENTRY) if raw else np.zeros(0, ENTRY)
        if len(entries) != len(wanted):
            raise ValueError(f"index {index_url} is short")
        # spans of consecutive records are adjacent in the tar: one read per run of records
        firsts = np.concatenate([[0], np.cumsum([b - a for a, b in record_runs])]).astype(np.int64)
        byte_runs = []
        for (a, b), f in zip(record_runs, firsts[:-1]):
            start = int(entries["offset"][f])
            end = int(entries["offset"][f + b - a - 1] + entries["length"][f + b - a - 1])
            byte_runs.append((start, end))
        blobs = data.read(byte_runs)
        out: dict[int, dict[str, np.ndarray]] = {}
        for (a, b), f, blob, (start, end) in zip(record_runs, firsts[:-1], blobs, byte_runs):
            if len(blob) != end - start:
                raise ValueError(f"{len(blob)} bytes read at offset {start}, the index expects {end - start} "
                                 "(truncated?)")
            for k in range(b - a):
                entry = entries[f + k]
                lo = int(entry["offset"]) - start
                span = blob[lo:lo + int(entry["length"])]
                if _digest(span) != entry["digest"].tobytes():
                    raise ValueError(f"record {a + k} (bytes {int(entry['offset'])}+{len(span)}) does not match "
                                     "its index digest")
                out[a + k] = _parse(span, a + k, np_dtype, record_type)
        return out
    finally:
        if counter is not None:
            counter.nbytes += index.nbytes + data.nbytes
        index.close()
        data.close()


def _parse(span: bytes, record: int, np_dtype: np.dtype, record_type: str | None) -> dict[str, np.ndarray]:
    records = list(shard_records(io.BytesIO(span), np_dtype, record_type, first=record))
    if len(records) != 1:
        raise ValueError(f"record {record} spans {len(records)} records in the tar")
    return records[0][1]


def write_index(shard: Path, tar_bytes: bytes, spans: list[tuple[int, int]]) -> tuple[int, str]:
    """Write NAME.idx next to the shard; (bytes, sha256) for the manifest."""
    blob = build_index(tar_bytes, spans)
    shard.with_name(index_name(shard.name)).write_bytes(blob)
    return len(blob), hashlib.sha256(blob).hexdigest()
