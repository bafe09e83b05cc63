"""The `.npy` files of a streamed result: written block by block, and verified.

An array result is one `.npy` file; a pytree result is a directory of them, one a leaf,
named by its key path. `ResultFiles` creates the files at their full (sparse) size,
writes each block's items at their offsets with a checksum of the bytes written, and
checks a reopened file's header, size and checksums against what its journal records.
"""

from __future__ import annotations

import hashlib
import io
import math
import operator
import os
import re
from typing import TYPE_CHECKING, Any

import jax
import numpy as np

from .._files import drop_cached, fsync_directory, pread_into, pwrite_all
from .._serialise import SerialisationError

if TYPE_CHECKING:
    from ._call import Layout

__all__ = ["AFRESH", "ResultFiles"]

AFRESH = "To start afresh, delete the file (and its journal) and call zm.to_file again."
_LOCK_NAME = "blocks.lock"  # in a pytree result's directory; `<path>.lock` beside a file
_DIGEST_LENGTH = 32  # hex digits of sha256 kept per block: 128 bits
_READ_SIZE = 8 << 20  # bytes read at a time when a file is verified


def _safe_name(key: str, taken: set[str]) -> str:
    """A file name for the leaf at key path `key`, not one of those `taken`."""
    name = re.sub(r"[^A-Za-z0-9_.-]+", "_", key).strip("_.") or "result"
    unique, k = name, 1
    while unique in taken:
        unique, k = f"{name}_{k}", k + 1
    taken.add(unique)
    return unique + ".npy"


def _npy_header(shape: tuple, dtype: Any) -> bytes:
    """The header of a C-ordered `.npy` file (format version 1.0) of this shape and dtype."""
    buffer = io.BytesIO()
    description = {
        "descr": np.lib.format.dtype_to_descr(np.dtype(dtype)),
        "fortran_order": False,
        "shape": tuple(shape),
    }
    np.lib.format.write_array_header_1_0(buffer, description)
    return buffer.getvalue()


def _read_exactly(fd: int, buffer: memoryview, offset: int) -> memoryview:
    """`buffer`, filled with the bytes at `offset` of a file whose size was checked, and
    those pages dropped from the page cache (read once, not kept)."""
    count = pread_into(fd, buffer, offset)
    drop_cached(fd, offset, len(buffer))
    if count < len(buffer):
        raise SerialisationError(
            f"zm.to_file: a file ended {len(buffer) - count} bytes before its journal's "
            f"blocks did, though its size was checked: it is being truncated. {AFRESH}"
        )
    return buffer


def _digest(array: np.ndarray) -> str:
    """The checksum of a C-contiguous array's bytes, as the journal records it."""
    data = array.view(np.uint8).reshape(-1).data if array.size else b""
    return hashlib.sha256(data).hexdigest()[:_DIGEST_LENGTH]


class ResultFiles:
    """The `.npy` files of a result: one file for an array, a directory for a pytree."""

    def __init__(self, path: str, layout: Layout):
        self.layout = layout
        self.single = layout.treedef.num_leaves == 1 and layout.paths == [""]
        if self.single:
            self.directory = os.path.dirname(os.path.abspath(path))
            self.paths = [path]
            self.journal = path + ".journal"
            self.lock = path + ".lock"
        else:
            self.directory = path
            taken: set[str] = set()
            self.paths = [os.path.join(path, _safe_name(key, taken)) for key in layout.paths]
            self.journal = os.path.join(path, "blocks.journal")
            self.lock = os.path.join(path, _LOCK_NAME)
        self.headers = [_npy_header(leaf.shape, leaf.dtype) for leaf in layout.leaves]
        self.fds: list[int] = []

    @property
    def where(self) -> str:
        """The path the caller gave: the file of an array, the directory of a pytree."""
        return self.paths[0] if self.single else self.directory

    def describe(self) -> list[dict[str, Any]]:
        return [
            {"file": os.path.basename(p), "shape": list(leaf.shape), "dtype": str(leaf.dtype)}
            for p, leaf in zip(self.paths, self.layout.leaves, strict=True)
        ]

    def create(self) -> None:
        """Every file, with its header and its full (sparse) size, on disk."""
        for path, header, leaf in zip(self.paths, self.headers, self.layout.leaves, strict=True):
            with open(path, "wb") as file:
                file.write(header)
                file.truncate(len(header) + leaf.size * np.dtype(leaf.dtype).itemsize)
                file.flush()
                os.fsync(file.fileno())
        fsync_directory(self.directory)

    def check(self) -> None:
        """Refuse files that are missing, or whose header or size is not the journal's."""
        for path, header, leaf in zip(self.paths, self.headers, self.layout.leaves, strict=True):
            size = len(header) + leaf.size * np.dtype(leaf.dtype).itemsize
            try:
                with open(path, "rb") as file:
                    found = file.read(len(header))
                    actual = os.fstat(file.fileno()).st_size
            except OSError as error:
                raise SerialisationError(
                    f"zm.to_file: {path} is missing or cannot be read ({error}), though its "
                    f"journal records blocks written to it. {AFRESH}"
                ) from error
            if found != header or actual != size:
                raise SerialisationError(
                    f"zm.to_file: {path} does not hold the header and size its journal "
                    f"expects (a {leaf.dtype} array of shape {leaf.shape}, {size} bytes; "
                    f"found {actual} bytes). {AFRESH}"
                )

    def open(self) -> None:
        self.fds = [os.open(path, os.O_RDWR) for path in self.paths]

    def write_block(self, leaf: int, piece: Any, axis: int, start: int) -> list | None:
        """Write a block's new items at their offsets: one run of bytes per index of the
        axes before `axis` (a single run when the block axis leads). Returns the region
        written and its checksum, `[leaf, before, after, first, stop, digest]` (items
        `first, ..., stop - 1` along the axis), or `None` when it is empty.

        The engine's last block ends at the total, moved back over the one before it:
        its items before the next multiple of the block size are that block's, on disk
        already, so each item is written, and checksummed, by one block only."""
        dtype = np.dtype(self.layout.leaves[leaf].dtype)
        piece = np.ascontiguousarray(piece, dtype)
        size = self.layout.leaves[leaf].size
        count = piece.shape[axis]
        before = math.prod(piece.shape[:axis])
        after = math.prod(piece.shape[axis + 1 :])
        if not count or not before or not after:
            return None
        first = -(-start // count) * count
        total = size // (before * after)
        runs = piece.reshape(before, count * after)[:, (first - start) * after :]
        base = len(self.headers[leaf])
        for p in range(before):
            offset = base + (p * total + first) * after * dtype.itemsize
            pwrite_all(self.fds[leaf], runs[p], offset)
        digest = _digest(np.ascontiguousarray(runs))
        return [leaf, before, after, first, start + count, digest]

    def write_rows(self, leaf: int, rows: Any, first: int) -> list:
        """Write whole rows (items along the first axis of the engine's view of leaf
        `leaf`, whose other axes are C-ordered after it) from row `first` on: one run of
        bytes, as a process of a sharded call writes its devices' rows. Returns the
        region written and its checksum, `[leaf, 1, row length, first, stop, digest]`."""
        dtype = np.dtype(self.layout.leaves[leaf].dtype)
        rows = np.ascontiguousarray(rows, dtype)
        after = math.prod(rows.shape[1:])
        offset = len(self.headers[leaf]) + first * after * dtype.itemsize
        pwrite_all(self.fds[leaf], rows.reshape(-1), offset)
        return [leaf, 1, after, first, first + rows.shape[0], _digest(rows)]

    def write_whole(self, leaf: int, value: Any) -> str:
        """Write a leaf that was returned whole; returns its checksum."""
        dtype = np.dtype(self.layout.leaves[leaf].dtype)
        value = np.ascontiguousarray(value, dtype)
        if value.size:
            pwrite_all(self.fds[leaf], value.reshape(-1), len(self.headers[leaf]))
        return _digest(value)

    def region(self, entry: Any) -> list:
        """A block's region as a journal records it, checked to lie inside its file."""
        leaf, before, after, first, stop, digest = entry
        leaf, before, after, first, stop = map(operator.index, entry[:5])
        size = self.layout.leaves[leaf].size if 0 <= leaf < len(self.paths) else 0
        inside = before > 0 and after > 0 and not size % (before * after)
        if not (inside and 0 <= first < stop <= size // (before * after)):
            raise ValueError(f"a block's region {entry} lies outside its file")
        if not isinstance(digest, str):
            raise TypeError(f"a block's checksum {digest!r} is not a string")
        return [leaf, before, after, first, stop, digest]

    def whole_leaf(self, entry: Any) -> list:
        """A leaf written whole and its checksum, as a journal records them, checked."""
        leaf, digest = entry
        if not 0 <= operator.index(leaf) < len(self.paths) or not isinstance(digest, str):
            raise ValueError(f"a whole leaf {entry} is not one of the files")
        return [leaf, digest]

    def verify(self, blocks: dict[int, list], whole: list) -> None:
        """Refuse files whose blocks (`{index: regions}`, as `write_block` returns them)
        or whole leaves (`[leaf, digest]`) no longer hold the bytes written there."""
        regions: dict[tuple[int, int, int], list] = {}
        for index, entries in sorted(blocks.items()):
            for leaf, before, after, first, stop, digest in entries:
                regions.setdefault((leaf, before, after), []).append((index, first, stop, digest))
        for leaf, digest in whole:
            if not self.layout.leaves[leaf].size:
                continue  # no bytes to check
            regions.setdefault((leaf, 1, self.layout.leaves[leaf].size), []).append(
                (None, 0, 1, digest)
            )
        for (leaf, before, after), spans in regions.items():
            found = self._digests(leaf, before, after, [(a, b) for _, a, b, _ in spans])
            for (index, first, stop, digest), actual in zip(spans, found, strict=True):
                if actual == digest:
                    continue
                what = (
                    f"block {index} of {self.paths[leaf]} (items {first} to {stop - 1} "
                    "along its block axis)"
                    if index is not None
                    else self.paths[leaf]
                )
                raise SerialisationError(
                    f"zm.to_file: {what} does not hold the bytes that were written there "
                    f"(its checksum is not the one in the journal {self.journal}): the "
                    f"file was changed or damaged after it was written. {AFRESH}"
                )

    def _digests(self, leaf: int, before: int, after: int, spans: list) -> list[str]:
        """The checksums of the items `a, ..., b - 1` of leaf `leaf` (seen as `before`
        runs of `total * after` elements) for each `(a, b)` in `spans`, as written.

        The file is read once, in pieces of at most `_READ_SIZE` bytes into one buffer:
        whole runs at a time when a run is short (blocks of columns), else each span of
        each run. Each piece leaves the page cache as soon as it is read: a resumed job's
        check of a large file would otherwise fill memory with pages read once."""
        itemsize = np.dtype(self.layout.leaves[leaf].dtype).itemsize
        total = self.layout.leaves[leaf].size // (before * after)
        step, row, base = after * itemsize, total * after * itemsize, len(self.headers[leaf])
        hashers = [hashlib.sha256() for _ in spans]
        buffer = memoryview(bytearray(_READ_SIZE))
        fd = os.open(self.paths[leaf], os.O_RDONLY)
        try:
            if row <= _READ_SIZE:
                rows = _READ_SIZE // row
                for p in range(0, before, rows):
                    count = min(rows, before - p)
                    data = np.frombuffer(
                        _read_exactly(fd, buffer[: count * row], base + p * row), np.uint8
                    ).reshape(count, row)
                    for hasher, (a, b) in zip(hashers, spans, strict=True):
                        hasher.update(np.ascontiguousarray(data[:, a * step : b * step]).data)
            else:
                for hasher, (a, b) in zip(hashers, spans, strict=True):
                    for p in range(before):
                        offset, end = base + p * row + a * step, base + p * row + b * step
                        while offset < end:
                            length = min(_READ_SIZE, end - offset)
                            hasher.update(_read_exactly(fd, buffer[:length], offset))
                            offset += length
        finally:
            os.close(fd)
        return [hasher.hexdigest()[:_DIGEST_LENGTH] for hasher in hashers]

    def sync(self) -> None:
        """Flush what was written, and drop it from the page cache: it counts as memory."""
        for fd in self.fds:
            os.fsync(fd)
            drop_cached(fd)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = []

    def load(self) -> Any:
        arrays = [np.load(path, mmap_mode="r") for path in self.paths]
        return jax.tree_util.tree_unflatten(self.layout.treedef, arrays)

    def exists(self) -> bool:
        if self.single:
            return os.path.exists(self.paths[0])
        # Locks are not results: `blocks.lock`, or `blocks.lock.p<k>` of a sharded call's processes.
        return os.path.isdir(self.directory) and any(
            not name.startswith(_LOCK_NAME) for name in os.listdir(self.directory)
        )
