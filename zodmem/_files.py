"""Writing files so that a crash cannot leave them half-written or unflushed.

The low-level file operations that `zm.save` and `zm.to_file` share: whole writes and
reads of a descriptor (a system call may move fewer bytes than asked), an atomic
replacement of a file, a durable append, the fsync of a directory (which makes a
file's creation or rename durable), and dropping a file's pages from the page cache.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterable
from typing import Any

__all__ = [
    "append_durably",
    "drop_cached",
    "fsync_directory",
    "pread_into",
    "pwrite_all",
    "write_all",
    "write_atomically",
]


def write_all(fd: int, data: Any) -> None:
    """Write all of `data` at the descriptor's position."""
    view = memoryview(data).cast("B")
    while view:
        view = view[os.write(fd, view) :]


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write all of `data` at `offset`, leaving the descriptor's position as it is."""
    view = memoryview(data).cast("B")
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def pread_into(fd: int, buffer: memoryview, offset: int) -> int:
    """Fill `buffer` (a writable byte view) with the bytes at `offset`; the count read,
    fewer than its length where the file ends first. Reading into one buffer again and
    again, rather than into new bytes objects, keeps a long read from taking fresh pages
    at every step."""
    done = 0
    while done < len(buffer):
        if hasattr(os, "preadv"):
            count = os.preadv(fd, [buffer[done:]], offset + done)
        else:  # a system whose Python has no `os.preadv`: read, then copy in
            chunk = os.pread(fd, len(buffer) - done, offset + done)
            count = len(chunk)
            buffer[done : done + count] = chunk
        if not count:
            break
        done += count
    return done


def append_durably(path: str, data: bytes) -> None:
    """Append `data` to the file at `path` and flush it to disk."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def drop_cached(fd: int, offset: int = 0, length: int = 0) -> None:
    """Drop a file's pages from the page cache (where the system allows it), those of
    `length` bytes at `offset` (`0`: to the end): pages written and flushed, or read
    once, would otherwise count as this process's memory."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)


def fsync_directory(path: str) -> None:
    """Flush a directory's entries to disk, so that a file created or renamed in it
    stays; a system that cannot open or flush a directory is left as it is."""
    try:
        fd = os.open(path or ".", os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomically(path: str, chunks: Iterable[bytes]) -> None:
    """Write a whole file or nothing: a temporary file beside `path` is filled, flushed
    to disk and renamed over `path`, so a crash leaves the previous file as it was."""
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".{os.path.basename(path)}.{secrets.token_hex(8)}.tmp")
    try:
        _write_and_rename(temporary, path, chunks)
    except OSError as error:
        # The temporary name is ours: the caller asked for `path`, so the error names it.
        if temporary not in (error.filename, error.filename2):
            raise
        renamed = type(error)(error.errno, error.strerror, path)
        raise renamed.with_traceback(error.__traceback__) from None
    fsync_directory(directory)  # make the rename itself durable


def _write_and_rename(temporary: str, path: str, chunks: Iterable[bytes]) -> None:
    # 0o666 lets the umask decide the permissions, as for any new file.
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
            file.flush()
            os.fsync(file.fileno())
        if os.path.exists(path):
            os.chmod(temporary, os.stat(path).st_mode & 0o7777)
        os.replace(temporary, path)
    except BaseException:
        try:
            os.unlink(temporary)
        except FileNotFoundError:
            pass
        raise
