"""Run the peers' own test suites against zodmem's drop-in namespaces.

For each peer, download its source distribution from PyPI, copy the chosen test files
into a scratch directory, point their imports at `zodmem.compat.<peer>` (and change
nothing else), and run them with pytest. Exits non-zero when a suite fails or when an
import line that should have been replaced was not found.

    python tests/peers/run_peers.py             # every peer
    python tests/peers/run_peers.py powerpax    # one of them

Needs zodmem installed with its test extras (`pip install -e ".[test]"`) and PyPI.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path


@dataclasses.dataclass(frozen=True)
class Rewrite:
    """One import line to replace, in every test file of the peer."""

    pattern: str  # a regex matched line by line (re.MULTILINE)
    replacement: str


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str
    version: str
    tests: tuple[str, ...]  # paths inside the source distribution
    rewrites: tuple[Rewrite, ...]
    tested_module: str  # an import of this module left in a test file is an error
    deselect: tuple[str, ...] = ()  # "file.py::test_name", relative to the scratch directory


PEERS = (
    Peer(
        name="powerpax",
        version="0.2.1",
        tests=(
            "tests/test_chunked_vmap.py",
            "tests/test_sliced_scan.py",
            "tests/test_checkpoint_chunked_scan.py",
            "tests/test_static.py",
        ),
        rewrites=(Rewrite(r"^import powerpax as (\w+)$", r"import zodmem.compat.powerpax as \1"),),
        tested_module="powerpax",
    ),
    Peer(
        name="optax",
        version="0.2.8",
        tests=("optax/microbatching/_microbatching_test.py",),
        rewrites=(
            Rewrite(
                r"^import optax\.microbatching\._microbatching as (\w+)$",
                r"import zodmem.compat.optax as \1",
            ),
        ),
        # optax's test helpers (optax._src.test_utils) stay: they are not what is tested.
        tested_module="optax.microbatching",
    ),
    Peer(
        name="zodiax",
        version="0.5.0",
        tests=("tests/test_diffops.py",),
        rewrites=(
            # The tests call `zodiax.diffops.<name>`, so bind `zodiax` to a namespace
            # whose `diffops` is the compat module.
            Rewrite(
                r"^import zodiax$",
                "import types, zodmem.compat.zodiax; "
                "zodiax = types.SimpleNamespace(diffops=zodmem.compat.zodiax)",
            ),
        ),
        tested_module="zodiax",
        # These test zodiax's private block planner, which has no counterpart in zodmem.
        deselect=(
            "test_diffops.py::test_get_batch_sizes_padding_and_shape",
            "test_diffops.py::test_get_batch_sizes_raises_for_too_many_batches",
        ),
    ),
)


def download(peer: Peer, into: Path) -> Path:
    """Download and unpack the peer's source distribution; return its top directory."""
    spec = f"{peer.name}=={peer.version}"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        + ["--no-binary", ":all:", "--dest", str(into), spec],
        check=True,
    )
    (archive,) = into.glob(f"{peer.name}-{peer.version}.tar.gz")
    with tarfile.open(archive) as tar:
        # The "data" filter refuses absolute paths and links out of the directory.
        extra = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
        tar.extractall(into, **extra)
    return into / f"{peer.name}-{peer.version}"


def rewrite_imports(source: str, peer: Peer, where: str) -> str:
    """Replace the peer's import lines; refuse when a rewrite matches nothing or an
    import of the tested module is left behind."""
    for rewrite in peer.rewrites:
        source, count = re.subn(rewrite.pattern, rewrite.replacement, source, flags=re.MULTILINE)
        if count == 0:
            raise SystemExit(f"{where}: no line matches {rewrite.pattern!r}; nothing replaced.")
    module = re.escape(peer.tested_module)
    left = re.findall(rf"^\s*(?:import|from)\s+{module}\b.*$", source, flags=re.MULTILINE)
    if left:
        raise SystemExit(f"{where}: the peer's own module is still imported: {left}")
    return source


def prepare(peer: Peer, scratch: Path) -> Path:
    """A directory holding the peer's chosen tests, importing zodmem instead."""
    unpacked = download(peer, scratch / "dist")
    suite = scratch / "suite"
    suite.mkdir()
    # An ini file here stops pytest from reading a configuration further up.
    (suite / "pytest.ini").write_text("[pytest]\n")
    for test in peer.tests:
        where = f"{peer.name} {peer.version}: {test}"
        source = (unpacked / test).read_text()
        (suite / Path(test).name).write_text(rewrite_imports(source, peer, where))
    for test in peer.deselect:
        file, name = test.split("::")
        if not re.search(rf"^def {name}\(", (suite / file).read_text(), flags=re.MULTILINE):
            raise SystemExit(f"{peer.name} {peer.version}: no test {test} to deselect.")
    return suite


def run(peer: Peer, scratch: Path) -> int:
    suite = prepare(peer, scratch)
    print(f"\n=== {peer.name} {peer.version}: {', '.join(peer.tests)}", flush=True)
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE"]
    command += ["--import-mode=importlib", "--rootdir", str(suite)]
    for test in peer.deselect:
        command += ["--deselect", test]
    command += [Path(test).name for test in peer.tests]
    return subprocess.run(command, cwd=suite).returncode


def main() -> int:
    names = [peer.name for peer in PEERS]
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("peers", nargs="*", help=f"some of {', '.join(names)} (default: all)")
    chosen = parser.parse_args().peers or names
    if unknown := set(chosen) - set(names):
        parser.error(f"unknown peers {sorted(unknown)}; choose from {names}")
    failed = []
    for peer in PEERS:
        if peer.name in chosen:
            scratch = Path(tempfile.mkdtemp(prefix=f"zodmem-peer-{peer.name}-"))
            try:
                if run(peer, scratch) != 0:
                    failed.append(peer.name)
            finally:
                shutil.rmtree(scratch, ignore_errors=True)
    print(f"\npeers failing: {', '.join(failed)}" if failed else "\nevery peer suite passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
