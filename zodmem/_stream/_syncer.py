"""The thread that makes a streamed result's written blocks durable while the next
blocks are computed: it fsyncs the files, then appends the journal's record of them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._journal import Journal
    from ._npy import ResultFiles

__all__ = ["Syncer"]


class Syncer:
    """Makes written blocks durable off the loop's thread: fsyncs the files, drops their
    pages from the cache, then records (and fsyncs) how many blocks are on disk.

    `record(count, blocks)` is the journal's record of them: by default `{"done": count,
    "blocks": blocks}`; a sharded call's journal records the rows its blocks wrote."""

    def __init__(
        self,
        files: ResultFiles,
        journal: Journal,
        record: Callable[[int, list], dict[str, Any]] | None = None,
    ):
        self._files, self._journal = files, journal
        self._record = record or _blocks_done
        self._pending: int | None = None
        self._blocks: list = []
        self._closed = False
        self._error: BaseException | None = None
        self._condition = threading.Condition()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def written(self, count: int, block: list) -> None:
        """Blocks `0, ..., count - 1` are written (not yet flushed); the last of them is
        `block`, `[index, regions]`."""
        with self._condition:
            self._pending = count
            self._blocks.append(block)
            self._condition.notify()

    def _loop(self) -> None:
        while True:
            with self._condition:
                while self._pending is None and not self._closed:
                    self._condition.wait()
                if self._pending is None:
                    return
                count, self._pending = self._pending, None
                blocks, self._blocks = self._blocks, []
            try:
                self._files.sync()
                self._journal.append(self._record(count, blocks))
            except BaseException as error:  # raised again on the caller's thread
                self._error = error
                return

    def close(self) -> None:
        with self._condition:
            self._closed = True
            self._condition.notify()
        self._thread.join()
        if self._error is not None:
            error, self._error = self._error, None
            raise error


def _blocks_done(count: int, blocks: list) -> dict[str, Any]:
    return {"done": count, "blocks": blocks}
