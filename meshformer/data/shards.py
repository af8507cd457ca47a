"""WebDataset tar shards of token arrays, their manifest, and verified streaming reads.

Shard layout: sample keys are zero-padded record numbers; members are raw little-endian token arrays
named by dtype (`<key>.tokens.u16`, or `<key>.src.u16` + `<key>.tgt.u16` for pairs). Raw arrays decode
with one `np.frombuffer` (no pickle, no npy header), which keeps the reader well ahead of training.
Tar headers use mtime 0 and fixed owners, so the same inputs give byte-identical shards.

Integrity: WebDataset silently yields fewer samples from a truncated tar. Every read here counts the
samples and hashes the bytes of the whole shard, and compares both with the manifest before any of its
samples are used; a mismatch raises `ShardError` naming the shard (or, with bad_shards="skip", the shard
is found by `verify_shards` when the loader is built, left out, and logged).
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
import tarfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlparse

import numpy as np
import webdataset as wds

from meshformer.errors import MeshformerError
from meshformer.folders import inside
from meshformer.renamed import renamed_attribute

from .shard_index import MemberError, dtype_ext, index_name, read_records, seekable, shard_records, write_index

FORMAT = "meshformer.shards"
FORMAT_VERSION = 1
_WDS_SCHEMES = {"", "file", "pipe", "http", "https", "sftp", "ftps", "scp", "gs", "ais", "hf"}


class ShardError(MeshformerError, RuntimeError):
    """A shard that is missing, corrupt, truncated, or does not match its manifest."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class ManifestError(MeshformerError, ValueError):
    """A manifest that is missing, malformed, or does not fit the requested run."""


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size <= 1 << 16 else np.dtype("<u4")


# ----------------------------------------------------------------------------- opening


def open_url(url: str) -> IO[bytes]:
    """Local path, file://, pipe:cmd, http(s) (via WebDataset's gopen) or any fsspec URL (s3://, gs://, ...)."""
    scheme = urlparse(url).scheme if "://" in url or url.startswith("pipe:") else ""
    if scheme in _WDS_SCHEMES:
        if scheme == "" and not Path(url).exists():
            raise FileNotFoundError(url)
        return wds.gopen(url, "rb")
    import fsspec  # only needed for object stores

    return fsspec.open(url, "rb").open()


def join_url(base: str, name: str) -> str:
    return posixpath.join(base, name) if base else name


# ----------------------------------------------------------------------------- manifest


@dataclass
class ShardInfo:
    name: str
    samples: int
    tokens: int
    bytes: int
    sha256: str
    index_bytes: int = 0  # NAME.idx sidecar (shard_index.py); 0: no index, the shard is always streamed
    index_sha256: str = ""


@dataclass
class Manifest:
    record_type: str  # "packed" | "pairs" (the manifest file's "kind")
    record_len: int  # tokens per packed record (0 for pairs)
    dtype: str  # "uint16" | "uint32"
    tokenizer: dict[str, Any]  # file, sha256, vocab_size, eos_id, pad_id, spec
    splits: dict[str, list[ShardInfo]]
    meta: dict[str, Any] = field(default_factory=dict)  # inputs, seed, eval_fraction, document counts, ...
    url: str = ""  # where it was read from; shard names resolve against its folder
    allow_remote_shards: bool = False  # set by the user's config only: its shard names may be paths, URLs, commands

    @property
    def base(self) -> str:
        return posixpath.dirname(self.url) if "://" in self.url else str(Path(self.url).parent) if self.url else ""

    def shard_url(self, info: ShardInfo) -> str:
        if self.allow_remote_shards and (_names_a_place(info.name) or posixpath.isabs(info.name)):
            return info.name
        return join_url(self.base, info.name)

    def to_json(self) -> str:
        splits = {name: {"samples": sum(s.samples for s in shards), "tokens": sum(s.tokens for s in shards),
                         "shards": [vars(s) for s in shards]} for name, shards in self.splits.items()}
        tree = {"format": FORMAT, "version": FORMAT_VERSION, "kind": self.record_type, "record_len": self.record_len,
                "seq_len": max(self.record_len - 1, 0), "dtype": self.dtype, "tokenizer": self.tokenizer,
                "splits": splits, "meta": self.meta}
        return json.dumps(tree, indent=1, sort_keys=True) + "\n"

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.to_json().encode()).hexdigest()


def manifest_url(spec: str) -> str:
    """Accept the manifest itself or the folder holding it."""
    if spec.endswith(".json"):
        return spec
    return join_url(spec.rstrip("/"), "manifest.json")


def read_manifest(spec: str, allow_remote_shards: bool = False) -> Manifest:
    """The manifest at `spec` (a folder or its manifest.json). Its shard and tokenizer names must be files in its
    own folder, unless `allow_remote_shards` (only ever from the user's own config, data.allow_remote_shards):
    then they may also be absolute paths, URLs or `pipe:` commands, read or run as they are."""
    url = manifest_url(spec)
    try:
        with open_url(url) as fh:
            tree = json.loads(fh.read())
    except FileNotFoundError:
        raise ManifestError(f"no manifest at {url}; run `meshformer data prepare` to create shards, or fix "
                            "data.shards") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ManifestError(f"{url}: manifest is not valid JSON ({err}); re-run `meshformer data prepare`") from None
    if tree.get("format") != FORMAT or tree.get("version") != FORMAT_VERSION:
        raise ManifestError(f"{url}: format {tree.get('format')!r} version {tree.get('version')!r}, this reader "
                            f"needs {FORMAT!r} version {FORMAT_VERSION}; re-run `meshformer data prepare`")
    try:
        splits = {name: [ShardInfo(**s) for s in split["shards"]] for name, split in tree["splits"].items()}
        manifest = Manifest(tree["kind"], tree["record_len"], tree["dtype"], tree["tokenizer"], splits,
                            tree.get("meta", {}), url, allow_remote_shards)
        shards = [info for infos in splits.values() for info in infos]
        files = [info.name for info in shards] + [tree["tokenizer"]["file"]]
        files += [index_name(info.name) for info in shards if info.index_sha256 and isinstance(info.name, str)]
    except (KeyError, TypeError) as err:
        raise ManifestError(f"{url}: manifest is missing a field ({err}); re-run `meshformer data prepare`") from None
    for name in files if not allow_remote_shards else ():
        _inside_manifest_folder(manifest, name)
    return manifest


def _names_a_place(name: str) -> bool:
    """A URL or command (`s3://..`, `pipe:cmd`) rather than a file name: a scheme before the first `/`."""
    return ":" in name.split("/", 1)[0]


def _inside_manifest_folder(manifest: Manifest, name: object) -> None:
    """A manifest names files in its own folder only: a shard or tokenizer named by an absolute path, `..`, a URL
    or a `pipe:` command would let a downloaded dataset read anywhere or run commands. (A remote folder has no
    local links to follow, so there the check is on the name alone.)"""
    inside(Path(manifest.base or "."), name, what=f"the manifest {manifest.url}",
           fix="a prepared dataset names only files in its own folder; re-run `meshformer data prepare`, or, if "
               "you wrote this manifest yourself, set data.allow_remote_shards=true (in a mixture: "
               "allow_remote_shards = true in its [[data.sources]] table)")


renamed_attribute(Manifest, "kind", "record_type")  # the Python name of earlier releases


# ----------------------------------------------------------------------------- writing


class ShardWriter:
    """Writes one tar shard deterministically and reports its ShardInfo. The bytes are those of webdataset's
    TarWriter (tarfile, PAX format, mode 0444, owner meshformer, mtime 0); the header of each member is built
    from a cached one of the same name length and size, which makes writing several times faster than tarfile's
    per-member header code."""

    def __init__(self, path: Path, dtype: np.dtype) -> None:
        self.path, self.dtype, self.ext = path, np.dtype(dtype), dtype_ext(dtype)
        self._fh = open(path, "wb")
        self._offset = 0
        self._headers: dict[tuple[int, int], bytes] = {}
        self.samples = self.tokens = 0
        self._spans: list[tuple[int, int]] = []  # each sample's bytes in the tar (headers + data + padding)

    def write(self, **arrays: np.ndarray) -> None:
        start = self._offset
        for name in sorted(arrays):  # members in key order, as webdataset writes them
            data = np.ascontiguousarray(arrays[name], dtype=self.dtype).tobytes()
            self._append(self._header(f"{self.samples:09d}.{name}.{self.ext}", len(data)), data)
            self.tokens += len(arrays[name])
        self._spans.append((start, self._offset))
        self.samples += 1

    def _header(self, name: str, size: int) -> bytes:
        template = self._headers.get((len(name), size))
        if template is None:
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uname, info.gname = size, 0, 0o444, "meshformer", "meshformer"
            built = info.tobuf(tarfile.PAX_FORMAT, "utf-8", "surrogateescape")
            if len(built) != tarfile.BLOCKSIZE or not name.isascii():  # a pax extended header: not cached
                return built
            template = self._headers[len(name), size] = built
        header = bytearray(template)
        header[:len(name)] = name.encode("ascii")
        header[148:156] = b" " * 8  # the checksum counts its own field as spaces
        header[148:155] = b"%06o\0" % sum(header)
        return bytes(header)

    def _append(self, header: bytes, data: bytes) -> None:
        padding = -len(data) % tarfile.BLOCKSIZE
        self._fh.write(header + data + tarfile.NUL * padding)
        self._offset += len(header) + len(data) + padding

    def close(self) -> ShardInfo:
        end = self._offset + 2 * tarfile.BLOCKSIZE  # tarfile's end: two zero blocks, padded to a whole record
        self._fh.write(tarfile.NUL * (2 * tarfile.BLOCKSIZE + -end % tarfile.RECORDSIZE))
        self._fh.close()
        data = self.path.read_bytes()
        index_bytes, index_sha = write_index(self.path, data, self._spans)
        return ShardInfo(self.path.name, self.samples, self.tokens, len(data), hashlib.sha256(data).hexdigest(),
                         index_bytes, index_sha)


def write_shards(records: Iterable[dict[str, np.ndarray]], dtype: np.dtype, per_shard: int,
                 path: Callable[[int], Path]) -> list[ShardInfo]:
    """Write records (each a dict of named token arrays) into shards of `per_shard` records, the k-th shard at
    path(k); returns their ShardInfos."""
    shards: list[ShardInfo] = []
    writer: ShardWriter | None = None
    for record in records:
        if writer is None:
            writer = ShardWriter(path(len(shards)), dtype)
        writer.write(**record)
        if writer.samples == per_shard:
            shards.append(writer.close())
            writer = None
    if writer is not None:
        shards.append(writer.close())
    return shards


# ----------------------------------------------------------------------------- reading


class _Hashing(io.RawIOBase):
    """Pass-through reader that hashes and counts every byte read."""

    def __init__(self, raw: IO[bytes]) -> None:
        self.raw, self.hash, self.nbytes = raw, hashlib.sha256(), 0

    def readable(self) -> bool:
        return True

    def readinto(self, buf: Any) -> int:
        data = self.raw.read(len(buf))
        n = len(data)
        buf[:n] = data
        self.hash.update(data)
        self.nbytes += n
        return n

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


def read_shard(url: str, info: ShardInfo, dtype: str, wanted: set[int] | None,
               counter: Any = None, record_type: str | None = None) -> dict[int, dict[str, np.ndarray]]:
    """Stream one shard; return the wanted records (all if None) after checking count and sha256, and every tar
    member as it is read (`shard_records`: regular files with the keys of `record_type`, the manifest's).

    counter: an object with an `nbytes` attribute to which the bytes read are added (read-volume stats).
    """
    np_dtype = np.dtype("<u2") if dtype == "uint16" else np.dtype("<u4")
    out: dict[int, dict[str, np.ndarray]] = {}
    samples = 0
    try:
        raw = open_url(url)
    except (FileNotFoundError, OSError) as err:
        raise ShardError(f"shard {url} cannot be opened ({err}); restore it or re-run `meshformer data prepare` "
                         "(or set data.bad_shards='skip' to train without it)", f"cannot be opened ({err})") from None
    try:
        stream = _Hashing(raw)
        for index, arrays in shard_records(io.BufferedReader(stream, 1 << 20), np_dtype, record_type):
            samples = index + 1
            if wanted is None or index in wanted:
                out[index] = arrays
        stream.drain()
        raw.close()  # a pipe: URL reports a failed command here
    except MemberError as err:
        raise _member_error(url, err) from None
    except (tarfile.TarError, OSError, EOFError, ValueError) as err:
        raise ShardError(f"shard {url} is corrupt ({type(err).__name__}: {err}); re-run `meshformer data "
                         "prepare` or restore the file (or set data.bad_shards='skip')",
                         f"corrupt ({type(err).__name__}: {err})") from None
    finally:
        _close_quietly(raw)  # every error path too: no leaked file handle or pipe: child per bad shard
        if counter is not None and "stream" in locals():
            counter.nbytes += stream.nbytes
    problem = check_shard(stream.hash.hexdigest(), stream.nbytes, samples, info)
    if problem:
        raise ShardError(f"shard {url} does not match the manifest: {problem}; the file was truncated, replaced "
                         "or corrupted. Re-run `meshformer data prepare` or restore it (or set "
                         "data.bad_shards='skip')", problem)
    return out


def read_shard_records(url: str, info: ShardInfo, dtype: str, records: np.ndarray,
                       counter: Any = None, record_type: str | None = None) -> dict[int, dict[str, np.ndarray]]:
    """The given records of one shard: ranged reads of just those when the store can seek and the shard has an
    index, else the whole shard streamed (also when every record is wanted: then the whole-file sha256 is
    checked too). Every member read is checked either way (`read_shard`)."""
    if not info.index_sha256 or not seekable(url) or len(np.unique(records)) == info.samples:
        return read_shard(url, info, dtype, set(np.asarray(records).tolist()), counter, record_type)
    np_dtype = np.dtype("<u2") if dtype == "uint16" else np.dtype("<u4")
    try:
        return read_records(url, index_name(url), info.samples, np_dtype, records, counter, record_type)
    except MemberError as err:
        raise _member_error(url, err) from None
    except (FileNotFoundError, OSError) as err:
        raise ShardError(f"shard {url} cannot be read ({err}); restore it or re-run `meshformer data prepare` "
                         "(or set data.bad_shards='skip' to train without it)", f"cannot be read ({err})") from None
    except (ValueError, tarfile.TarError, EOFError) as err:
        raise ShardError(f"shard {url} does not match the manifest: {err}; the file was truncated, replaced or "
                         "corrupted. Re-run `meshformer data prepare` or restore it (or set "
                         "data.bad_shards='skip')", str(err)) from None


def _member_error(url: str, err: MemberError) -> ShardError:
    return ShardError(f"shard {url}: {err} (a prepared shard holds only regular files named "
                      "<record>.<key>.<u16|u32>); re-run `meshformer data prepare` or restore the file (or set "
                      "data.bad_shards='skip')", str(err))


def _close_quietly(raw: IO[bytes]) -> None:
    """Close a stream that may already be closed; errors here are secondary to the one being raised."""
    try:
        raw.close()
    except Exception:  # a pipe: command's exit status was already reported (or is moot)
        pass


def check_shard(sha256: str, nbytes: int, samples: int, info: ShardInfo) -> str:
    """'' when the shard matches its manifest entry, else what differs."""
    if samples != info.samples:
        return f"{samples} samples read, manifest says {info.samples}"
    if nbytes != info.bytes:
        return f"{nbytes} bytes read, manifest says {info.bytes}"
    if sha256 != info.sha256:
        return f"sha256 {sha256[:16]}.. != manifest {info.sha256[:16]}.."
    return ""
