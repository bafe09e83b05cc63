"""The exclusive lock of a streamed result's path, held while `zm.to_file` writes it.

The lock is a file (`<path>.lock` beside an array's file, `blocks.lock` in a pytree's
directory) locked with `flock`, which refuses a second call on the path whether it
runs in another process or in another thread of this one. The file is removed as the
call ends, before its lock is let go.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator

from .._serialise import SerialisationError

__all__ = ["exclusive"]


@contextlib.contextmanager
def exclusive(lock: str, where: str) -> Iterator[None]:
    """Hold the lock file `lock` of the result at `where` while the call reads and
    writes it: a second call on the same path, in another process or in another
    thread, is refused."""
    os.makedirs(os.path.dirname(os.path.abspath(lock)), exist_ok=True)
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise SerialisationError(
                f"zm.to_file: {where} is being written by another call (another process, "
                f"or another thread of this one, holds its lock {lock}). Wait for "
                "that call to end, then call zm.to_file again to resume or read the "
                "result; or write to another path."
            ) from None
        try:
            current = os.path.samestat(os.fstat(fd), os.stat(lock))
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)  # removed by the call that held it as it ended: lock the new file
    try:
        yield
    finally:
        try:
            os.unlink(lock)  # before the lock is let go, so no one locks it again
        except FileNotFoundError:
            pass
        os.close(fd)
