"""The journal of a streamed result's files: checksummed one-line records of what call
made them and which blocks are on disk.

Each record is a line `<first 16 hex digits of the sha256 of the JSON> <JSON>`, so a
line cut short by a crash, or changed on disk, is told from a whole one. A record is
appended, and fsynced, only once the bytes it counts are on disk.
"""

from __future__ import annotations

import glob
import hashlib
import json
import operator
import os
from typing import TYPE_CHECKING, Any

from .._files import append_durably, write_atomically
from .._serialise import SerialisationError
from ._npy import AFRESH

if TYPE_CHECKING:
    from ._npy import ResultFiles

__all__ = ["Journal", "RowJournal", "read_records", "check_header"]

_JOURNAL_FORMAT = "zodmem.to_file"
_JOURNAL_VERSION = 2


def _record(record: dict[str, Any]) -> bytes:
    """A record as the line the journal holds."""
    body = json.dumps(record, separators=(",", ":"), sort_keys=True)
    return f"{hashlib.sha256(body.encode()).hexdigest()[:16]} {body}\n".encode()


def _header(fingerprint: dict[str, str], files: Any, fields: dict[str, Any]) -> dict[str, Any]:
    """A journal's first record: its format, the call's fingerprint, the files it
    describes and `fields`."""
    return {
        "format": _JOURNAL_FORMAT,
        "version": _JOURNAL_VERSION,
        "fingerprint": fingerprint,
        "files": files.describe(),
        **fields,
    }


class Journal:
    """The records beside a file: a header record (the call's fingerprint, the files,
    the block size), then `{"done": k, "blocks": [[index, regions], ...]}` once blocks
    `0, ..., k - 1` are on disk, listing the blocks new since the last such record with
    the checksum of each region they wrote, then `{"complete": true, "whole": [[leaf,
    checksum], ...]}` with the leaves written whole. Each record is one line with a
    checksum; a torn last line (a write cut short) is ignored, a damaged one before it
    is refused. Opening a journal verifies the blocks it counts against the files."""

    def __init__(self, path: str):
        self.path = path
        self.done = 0
        self.complete = False
        self.blocks: dict[int, list] = {}
        self.whole: list = []

    def open(self, fingerprint: dict[str, str], files: ResultFiles) -> dict[str, Any] | None:
        """The header of an existing journal, checked against this call, or `None`
        when there is none (and no file in the way)."""
        if not os.path.exists(self.path):
            if files.exists():
                raise SerialisationError(
                    f"zm.to_file: {files.where} exists but has no journal ({self.path}): it was "
                    "not written by zm.to_file, or its journal was removed, so its blocks "
                    "cannot be trusted. Delete it, or choose another path, to start afresh."
                )
            return None
        records = read_records(self.path)
        header = records[0]
        check_header(header, self.path, fingerprint, files)
        if "sharded" in header:
            raise SerialisationError(
                f"zm.to_file: the journal {self.path} records the rows of a sharded call, "
                f"not the blocks of a call on one device. {AFRESH}"
            )
        try:
            for record in records[1:]:
                if "done" in record:
                    if not isinstance(record["done"], int) or record["done"] < self.done:
                        raise ValueError("blocks out of order")
                    self.done = record["done"]
                    for index, regions in record["blocks"]:
                        self.blocks[operator.index(index)] = [files.region(r) for r in regions]
                elif record.get("complete") is True:
                    self.complete = True
                    self.whole = [files.whole_leaf(entry) for entry in record["whole"]]
            if sorted(self.blocks) != list(range(self.done)):
                raise ValueError(f"checksums of blocks {sorted(self.blocks)} for {self.done}")
        except (KeyError, TypeError, ValueError) as error:
            raise SerialisationError(
                f"zm.to_file: the journal {self.path} does not record the blocks on disk "
                f"in order with their checksums ({error}). {AFRESH}"
            ) from error
        if self.done == 0 and not self.complete:
            files.create()  # nothing counted yet: the files may not have been made
        else:
            files.check()
            files.verify(self.blocks, self.whole)
        return header

    def create(
        self, fingerprint: dict[str, str], files: ResultFiles, header: dict[str, Any]
    ) -> None:
        """A new journal (written whole, then renamed into place), then the files."""
        os.makedirs(files.directory, exist_ok=True)
        record = _header(fingerprint, files, header)
        write_atomically(self.path, [_record(record)])
        files.create()

    def append(self, record: dict[str, Any]) -> None:
        append_durably(self.path, _record(record))


class RowJournal:
    """The journal of one process of a sharded call: the rows its devices wrote.

    Beside the file, `<journal>.p<process index>`: a header record (the call's
    fingerprint, the files, and `"sharded"`: how the result was split, over which mesh and
    processes), then `{"rows": [region, ...]}` records of rows on disk, each region
    `[leaf, 1, row length, first row, stop row, checksum]` as `ResultFiles.write_rows`
    returns it, and a `{"layout": ...}` record for each later run (whose mesh may differ:
    rows are rows, whichever device wrote them)."""

    def __init__(self, files: ResultFiles, process: int):
        self.path = f"{files.journal}.p{process}"

    @staticmethod
    def paths(files: ResultFiles) -> list[str]:
        """The journals of every process that wrote rows of `files`, in process order."""
        found = glob.glob(glob.escape(files.journal) + ".p*")
        numbered = [(p[len(files.journal) + 2 :], p) for p in found]
        return [p for key, p in sorted((int(k), p) for k, p in numbered if k.isdigit())]

    @staticmethod
    def read(path: str, fingerprint: dict[str, str], files: ResultFiles) -> list[list]:
        """The regions the journal at `path` counts, checked: refused when the journal is
        of another call, of another layout (not rows of a sharded call) or damaged."""
        records = read_records(path)
        header = records[0]
        check_header(header, path, fingerprint, files)
        sharded = header.get("sharded")
        if not isinstance(sharded, dict) or sharded.get("axis") != 0:
            raise SerialisationError(
                f"zm.to_file: the journal {path} is of another layout (its header records "
                f"{sharded!r}, not rows along the first axis of a sharded call), so its "
                f"blocks cannot be placed. {AFRESH}"
            )
        if header.get("files") != files.describe():
            raise SerialisationError(
                f"zm.to_file: the journal {path} describes the files {header.get('files')}, "
                f"not this call's {files.describe()}. {AFRESH}"
            )
        regions = []
        try:
            for record in records[1:]:
                for entry in record.get("rows", ()):
                    region = files.region(entry)
                    if region[1] != 1:
                        raise ValueError(f"the region {entry} is not a run of whole rows")
                    regions.append(region)
        except (KeyError, TypeError, ValueError) as error:
            raise SerialisationError(
                f"zm.to_file: the journal {path} does not record whole rows on disk with "
                f"their checksums ({error}). {AFRESH}"
            ) from error
        return regions

    def start(
        self,
        fingerprint: dict[str, str],
        files: ResultFiles,
        layout: dict[str, Any],
    ) -> None:
        """This process's journal: made (written whole, then renamed into place) with its
        header, or, when an earlier run left one, this run's layout appended to it."""
        if os.path.exists(self.path):
            self.append({"layout": layout})
            return
        os.makedirs(files.directory, exist_ok=True)
        record = _header(fingerprint, files, {"sharded": {"axis": 0, **layout}})
        write_atomically(self.path, [_record(record)])

    def append(self, record: dict[str, Any]) -> None:
        append_durably(self.path, _record(record))


def read_records(path: str) -> list[dict[str, Any]]:
    """The whole records of the journal at `path`, its header first. A torn last line (a
    write cut short by a crash) is dropped from the file, so later records follow the
    last whole one; a damaged line before it, or a journal with no header, is refused."""
    with open(path, "rb") as file:
        data = file.read()
    records, valid = [], 0
    lines = data.split(b"\n")
    for number, line in enumerate(lines[:-1], start=1):
        record = _parse(line)
        if record is None:
            last = number == len(lines) - 1 and not lines[-1]
            if last and records:
                break  # a record cut short by a crash: its block is not counted
            raise SerialisationError(
                f"zm.to_file: record {number} of the journal {path} is damaged "
                f"(its checksum does not match). {AFRESH}"
            )
        records.append(record)
        valid += len(line) + 1
    if not records:
        raise SerialisationError(
            f"zm.to_file: the journal {path} holds no readable header record. {AFRESH}"
        )
    if valid < len(data):
        with open(path, "r+b") as file:
            file.truncate(valid)  # later records go after the last whole one
            os.fsync(file.fileno())
    return records


def check_header(
    header: dict[str, Any], path: str, fingerprint: dict[str, str], files: ResultFiles
) -> None:
    """Refuse a journal header of another format or version, or of another call."""
    if header.get("format") != _JOURNAL_FORMAT:
        raise SerialisationError(
            f"zm.to_file: {path} is not a journal of zm.to_file (format "
            f"{header.get('format')!r}). {AFRESH}"
        )
    if header.get("version") != _JOURNAL_VERSION:
        raise SerialisationError(
            f"zm.to_file: the journal {path} was written by another version of "
            f"zodmem (journal version {header.get('version')!r}; this one reads version "
            f"{_JOURNAL_VERSION}), so its blocks cannot be checked. {AFRESH}"
        )
    recorded = header.get("fingerprint")
    if not isinstance(recorded, dict):
        raise SerialisationError(f"zm.to_file: the journal {path} holds no fingerprint. {AFRESH}")
    differs = [
        f"its {name} (the file: {recorded.get(name)}; this call: {value})"
        for name, value in fingerprint.items()
        if recorded.get(name) != value
    ]
    if differs:
        raise SerialisationError(
            f"zm.to_file: {files.where} was made by another call: {'; '.join(differs)} "
            f"differ. A file resumes only the call that made it. {AFRESH}"
        )


def _parse(line: bytes) -> dict[str, Any] | None:
    """The record of a line, or `None` when its checksum or JSON is damaged."""
    checksum, _, body = line.partition(b" ")
    if hashlib.sha256(body).hexdigest()[:16].encode() != checksum:
        return None
    try:
        record = json.loads(body)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
