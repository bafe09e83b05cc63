"""Developer sessions: `nox -s tests`, `nox -s lint`, `nox -s benchmarks`."""

import nox

nox.options.sessions = ["lint", "tests"]


@nox.session
def tests(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-n", "auto", "tests", *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", "zodmem", "tests", "benchmarks", "examples", "noxfile.py")
    session.run("ruff", "format", "--check", "zodmem", "tests", "benchmarks", "examples")


@nox.session
def typecheck(session: nox.Session) -> None:
    session.install("-e", ".", "pyright")
    session.run("pyright", "zodmem")


@nox.session
def benchmarks(session: nox.Session) -> None:
    session.install("-e", ".[test]")
    session.run("python", "benchmarks/hessian_memory.py", *session.posargs)
