"""The public signatures of the estimators, the structured operators, KFAC and `load`, and
the constructors of the transforms and the losses: every parameter annotated with a type
more precise than `Any`, and a wrong type refused at the call, by the library itself (not
only by the tests' import hook), in a `TypeError` that names the parameter."""

import collections.abc
import inspect
import json
import os
import subprocess
import sys
import textwrap
import typing

import equinox as eqx
import pytest

import zodmem as zm
import zodmem.losses

# The public names whose signatures are typed: functions, and classes whose public
# methods, constructor and call are.
TYPED = {
    "eigsh",
    "trace",
    "diagonal",
    "logdet",
    "trace_function",
    "spectral_density",
    "low_rank",
    "solve",
    "marginal_variances",
    "covariance",
    "approximation_error",
    "influence",
    "influence_scorer",
    "BlockDiagonal",
    "LowRankDiagonal",
    "KroneckerFactored",
    "KFAC",
    "EKFAC",
    "load",
}


def _public_names():
    """`(name, object)` for every public name of zodmem and zodmem.losses."""
    for module in (zm, zodmem.losses):
        for name in module.__all__:
            yield name, getattr(module, name)


def _methods(cls):
    """The public methods of `cls`, its constructor and its call, as the class has them
    (inherited ones too, from zodmem's own bases)."""
    seen = {}
    for base in reversed(cls.__mro__):
        if not base.__module__.startswith("zodmem"):
            continue
        for key, value in vars(base).items():
            if inspect.isfunction(value) and (
                not key.startswith("_") or key in ("__init__", "__call__")
            ):
                seen[key] = value
    return seen


def _untyped(function):
    """The parameters of `function` annotated `Any` or not at all (bar `self`, `*args`
    and `**kwargs`, which pass a user's arguments through)."""
    found = []
    for parameter in inspect.signature(function).parameters.values():
        if parameter.name == "self" or parameter.kind in (
            parameter.VAR_POSITIONAL,
            parameter.VAR_KEYWORD,
        ):
            continue
        if parameter.annotation in (inspect.Parameter.empty, typing.Any, "Any"):
            found.append(parameter.name)
    return found


def _checked_at_the_call(function):
    """Whether `function` is wrapped in the library's own check of its annotations,
    `typechecked` (not only in the tests' import hook), which marks its wrapper."""
    return getattr(function, "_typechecked", False)


def test_every_parameter_of_the_typed_names_is_annotated_precisely():
    untyped, unchecked, walked = {}, [], set()
    for name, value in _public_names():
        if name not in TYPED:
            continue
        walked.add(name)
        functions = (
            {name: value}
            if inspect.isfunction(value)
            else {f"{name}.{key}": method for key, method in _methods(value).items()}
        )
        assert functions, name
        for label, function in functions.items():
            if missing := _untyped(function):
                untyped[label] = missing
            takes = [p for p in inspect.signature(function).parameters if p != "self"]
            if takes and not _checked_at_the_call(function):
                unchecked.append(label)
    assert walked == TYPED, f"not public any more: {TYPED - walked}"
    assert not untyped, f"annotated Any or not at all: {untyped}"
    assert not unchecked, f"annotations not checked at the call: {unchecked}"


# The transforms and the built-in losses: constructors that Equinox writes from their
# fields, each parameter typed by its field (or its field's converter) and checked at the
# call by `typechecked_constructor`.
CONSTRUCTED = {
    "BatchedJacobian",
    "BatchedHessian",
    "BatchedGGN",
    "ChunkedVmap",
    "Microbatcher",
    "SlicedScan",
    "CheckpointedScan",
    "SquaredError",
    "GaussianNLL",
    "PoissonNLL",
    "SoftmaxCrossEntropy",
}


def test_the_constructors_of_the_transforms_and_losses_are_typed():
    untyped, unchecked, walked = {}, [], set()
    for name, value in _public_names():
        if name not in CONSTRUCTED:
            continue
        walked.add(name)
        if missing := _untyped(value.__init__):
            untyped[name] = missing
        if not _checked_at_the_call(value.__init__):
            unchecked.append(name)
    assert walked == CONSTRUCTED, f"not public any more: {CONSTRUCTED - walked}"
    assert not untyped, f"constructor parameters annotated Any or not at all: {untyped}"
    assert not unchecked, f"constructors not checked at the call: {unchecked}"


def test_a_field_typed_any_is_an_untyped_constructor_parameter():
    """The check above sees a field, or a converter's parameter, annotated `Any`."""
    from zodmem._checks import as_index, typechecked_constructor

    @typechecked_constructor
    class Loose(eqx.Module):
        fn: collections.abc.Callable[..., typing.Any]
        size: int = eqx.field(default=1, static=True)
        anything: typing.Any = None
        converted: int | None = eqx.field(default=None, converter=as_index)

    assert _untyped(Loose.__init__) == ["anything", "converted"]
    assert _checked_at_the_call(Loose.__init__)
    with pytest.raises(TypeError, match="parameter 'size'"):
        Loose(len, size="one")


# Each case: a call with one argument of a wrong type, and the parameter it names. They run
# in a process of their own, which imports zodmem without the tests' import hook.
_CASES = textwrap.dedent(
    """
    import json, sys
    import jax, jax.numpy as jnp, lineax as lx, numpy as np
    import zodmem as zm

    assert not any("jaxtyping" in type(finder).__module__ for finder in sys.meta_path)
    matrix = jnp.diag(jnp.arange(1.0, 7.0))
    op = lx.MatrixLinearOperator(matrix, lx.symmetric_tag)
    key = jax.random.key(0)
    low = zm.LowRankDiagonal(jnp.eye(6, 1), jnp.ones(1), jnp.ones(6))
    blocks = zm.BlockDiagonal([jnp.eye(2), jnp.eye(3)])
    cases = {
        "eigsh progress": (lambda: zm.eigsh(op, 2, progress=1), "progress"),
        "trace sharding": (lambda: zm.trace(op, sharding=3), "sharding"),
        "diagonal pytree": (lambda: zm.diagonal(op, pytree="yes"), "pytree"),
        "logdet max_memory": (
            lambda: zm.logdet(op, num_probes=4, key=key, max_memory=1.5), "max_memory"
        ),
        "spectral_density progress": (
            lambda: zm.spectral_density(op, progress="no"), "progress"
        ),
        "low_rank operator": (lambda: zm.low_rank(matrix, 2), "operator"),
        "solve solver": (lambda: zm.solve(op, jnp.ones(6), solver="cg"), "solver"),
        "covariance pseudo_inverse": (
            lambda: zm.covariance(matrix, pseudo_inverse="yes"), "pseudo_inverse"
        ),
        "approximation_error exact": (
            lambda: zm.approximation_error(op, matrix, key=key), "exact"
        ),
        "LowRankDiagonal.logdet damping": (lambda: low.logdet(damping=jnp.ones(2)), "damping"),
        "BlockDiagonal.mv vector": (lambda: blocks.mv("vector"), "vector"),
        "KFAC progress": (
            lambda: zm.KFAC(jnp.sin, zm.losses.SquaredError(), progress=1), "progress"
        ),
        "load path": (lambda: zm.load(3), "path"),
        "BatchedHessian progress": (lambda: zm.BatchedHessian(jnp.sum, progress=1), "progress"),
        "BatchedGGN nbatches": (
            lambda: zm.BatchedGGN(jnp.sin, zm.losses.SquaredError(), nbatches=2.0), "nbatches"
        ),
        "ChunkedVmap in_axes": (
            lambda: zm.ChunkedVmap(jnp.sin, chunk_size=2, in_axes="x"), "in_axes"
        ),
        "Microbatcher argnames": (
            lambda: zm.Microbatcher(jnp.sin, microbatch_size=2, argnames=3), "argnames"
        ),
        "SlicedScan step": (lambda: zm.SlicedScan(lambda c, x: (c, x), step=1.5), "step"),
        "CheckpointedScan unroll": (
            lambda: zm.CheckpointedScan(lambda c, x: (c, x), unroll="2"), "unroll"
        ),
        "SquaredError targets": (lambda: zm.losses.SquaredError(targets=2.5), "targets"),
        "influence damping": (
            lambda: zm.influence(
                lambda w, x: jnp.sum(w * x), op, jnp.ones(6), train=(matrix,), damping="0.1"
            ),
            "damping",
        ),
    }
    results = {}
    for label, (call, name) in cases.items():
        try:
            call()
        except TypeError as error:
            results[label] = [name, str(error)]
        else:
            results[label] = [name, None]
    print(json.dumps(results))
    """
)


@pytest.fixture(scope="module")
def refusals():
    environment = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(
        [sys.executable, "-c", _CASES],
        capture_output=True,
        text=True,
        check=True,
        env=environment,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(
    "label",
    [
        "eigsh progress",
        "trace sharding",
        "diagonal pytree",
        "logdet max_memory",
        "spectral_density progress",
        "low_rank operator",
        "solve solver",
        "covariance pseudo_inverse",
        "approximation_error exact",
        "LowRankDiagonal.logdet damping",
        "BlockDiagonal.mv vector",
        "KFAC progress",
        "load path",
        "BatchedHessian progress",
        "BatchedGGN nbatches",
        "ChunkedVmap in_axes",
        "Microbatcher argnames",
        "SlicedScan step",
        "CheckpointedScan unroll",
        "SquaredError targets",
        "influence damping",
    ],
)
def test_a_wrong_type_is_a_type_error_that_names_the_parameter(refusals, label):
    name, message = refusals[label]
    assert message is not None, f"{label}: no TypeError"
    # beartype's words (`parameter 'name'`) or the library's own (`name`).
    assert f"parameter '{name}'" in message or f"`{name}`" in message, message
