"""The file format: a signed JSON header followed by the arrays, written atomically
(by `zodmem._files.write_atomically`).

```
zodmem <sha256 of the header line, 64 hex digits>\\n
<header: one line of JSON>\\n
<payload: the array leaves of the stack, as written by eqx.tree_serialise_leaves>
```

The header records the format (`"format": "zodmem.transform"`, `"version": 1`), the
versions of zodmem, JAX and Equinox that wrote it, what the caller puts in it (the
stack and its table of array leaves) and the payload's length and sha256.
"""

from __future__ import annotations

import hashlib
import json
import sys
from typing import Any

import equinox as eqx
import jax

from .._files import write_atomically
from ._error import SerialisationError

__all__ = ["corrupt", "read_file", "write_file"]

FORMAT_NAME = "zodmem.transform"
FORMAT_VERSION = 1
_SIGNATURE = b"zodmem "
_DIGEST_LINE_LENGTH = len(_SIGNATURE) + 64 + 1


def write_file(path: str, contents: dict[str, Any], payload: bytes) -> None:
    """Write `contents` (JSON values) into the header and `payload` after it, atomically."""
    header = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "written_by": {
            "zodmem": _zodmem_version(),
            "jax": jax.__version__,
            "equinox": getattr(eqx, "__version__", "unknown"),
        },
        **contents,
        "payload": {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()},
    }
    header_bytes = json.dumps(header, separators=(",", ":"), allow_nan=False).encode("ascii")
    digest_line = _SIGNATURE + hashlib.sha256(header_bytes).hexdigest().encode() + b"\n"
    write_atomically(path, [digest_line, header_bytes, b"\n", payload])


def read_file(path: str) -> tuple[dict[str, Any], bytes]:
    """The header and payload of the file at `path`, once both checksums and the format
    version are verified."""
    with open(path, "rb") as file:
        data = file.read()
    if not data.startswith(_SIGNATURE):
        if len(data) < len(_SIGNATURE) and _SIGNATURE.startswith(data):
            raise corrupt(f"it holds only {len(data)} bytes")
        raise SerialisationError(
            "This is not a zodmem file (it does not begin with the zodmem signature), or "
            "its first bytes are corrupted."
        )
    if len(data) < _DIGEST_LINE_LENGTH:
        raise corrupt("it ends inside the checksum line")
    expected = data[len(_SIGNATURE) : _DIGEST_LINE_LENGTH - 1]
    if data[_DIGEST_LINE_LENGTH - 1 : _DIGEST_LINE_LENGTH] != b"\n" or not all(
        c in b"0123456789abcdef" for c in expected
    ):
        raise corrupt("the checksum line is damaged")
    end = data.find(b"\n", _DIGEST_LINE_LENGTH)
    if end < 0:
        raise corrupt("it ends inside the header")
    header_bytes = data[_DIGEST_LINE_LENGTH:end]
    if hashlib.sha256(header_bytes).hexdigest().encode() != expected:
        raise corrupt("the header does not match its sha256 checksum")
    try:
        header = json.loads(header_bytes.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise corrupt(f"the header is not valid JSON ({error})") from error
    if not isinstance(header, dict):
        raise corrupt("the header is not a JSON object")
    if header.get("format") != FORMAT_NAME:
        raise SerialisationError(
            f"The file's format is {header.get('format')!r}, not {FORMAT_NAME!r}: it was not "
            "written by zodmem.save."
        )
    version = header.get("version")
    written_by = header.get("written_by")
    writer = written_by.get("zodmem") if isinstance(written_by, dict) else None
    if version != FORMAT_VERSION or type(version) is not int:
        raise SerialisationError(
            f"The file uses format version {version!r} of {FORMAT_NAME}, but this zodmem "
            f"({_zodmem_version()}) reads version {FORMAT_VERSION} only. It was written by "
            f"zodmem {writer or '(unknown)'}; load it with a matching version of zodmem."
        )
    payload = data[end + 1 :]
    try:
        expected_length = header["payload"]["bytes"]
        expected_digest = header["payload"]["sha256"]
    except (KeyError, TypeError) as error:
        raise corrupt("the header has no payload entry") from error
    if len(payload) < expected_length:
        raise corrupt(f"its arrays hold {len(payload)} bytes of the {expected_length} written")
    if len(payload) > expected_length:
        raise corrupt(
            f"it has {len(payload) - expected_length} bytes after the {expected_length} "
            "bytes of arrays written"
        )
    if hashlib.sha256(payload).hexdigest() != expected_digest:
        raise corrupt("the arrays do not match their sha256 checksum")
    return header, payload


def corrupt(reason: str) -> SerialisationError:
    """The error for a file whose bytes are not what was written; `reason` says where."""
    return SerialisationError(
        f"The file is truncated or corrupted: {reason}. It cannot be loaded; save the "
        "transform again."
    )


def _zodmem_version() -> str:
    return getattr(sys.modules.get("zodmem"), "__version__", "unknown")
