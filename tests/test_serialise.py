"""`zm.save` / `zm.load`: round trips of whole stacks, refusals, corrupted files, `like`."""

import dataclasses
import enum
import errno
import functools
import hashlib
import inspect
import json
import os
import runpy
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import serialise_functions
import serialise_wrapped
from helpers import close
from hypothesis import given, strategies as st

import zodmem as zm
import zodmem._serialise as serialise

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "save_and_load.py"


# --------------------------------------------------------------------------------------
# Importable functions, classes and transforms, defined at module level


def quadratic(params, data):
    return jnp.sum((params["w"] * data + params["b"]) ** 2)


def model_loss(model, xs, ys):
    return jnp.mean((jax.vmap(model)(xs) - ys) ** 2)


def scale(x, factor=2.0):
    return factor * x


def scan_step(carry, x):
    carry = 0.5 * carry + x
    return carry, carry**2


def zeros_like_shape(shape):
    return jnp.zeros(shape.shape, shape.dtype)


def add_update(carry, value, index):
    return carry + value


def identity(x):
    return x


jitted_scale = jax.jit(scale)
filter_jitted_scale = eqx.filter_jit(scale)
# A wrapper whose `__module__` names the module of the function it wraps, not this one.
grad_of_other = jax.grad(serialise_functions.loss)


class Colour(enum.Enum):
    RED = "red"
    BLUE = "blue"


class Level(enum.IntEnum):
    LOW = 1
    HIGH = 2


class Pair(NamedTuple):
    first: Any
    second: Any


class Probe(zm.AbstractTransform):
    """A transform with one free-form static option, to exercise the value encoding."""

    fn: Callable[..., Any]
    option: Any = eqx.field(default=None, static=True, kw_only=True)

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)


class TwoModels(zm.AbstractTransform):
    """A transform holding a second module beside `fn`."""

    fn: Callable[..., Any]
    other: Any

    def __call__(self, x):
        return self.fn(x) + self.other(x)


class Counted(zm.AbstractTransform):
    """A transform that records every time it is built."""

    fn: Callable[..., Any]
    built: ClassVar[list] = []

    def __check_init__(self):
        Counted.built.append(type(self.fn).__name__)

    def __call__(self, x):
        return self.fn(x)


class Rebuilt(zm.AbstractTransform):
    """A transform whose constructor does not take its fields back."""

    fn: Callable[..., Any]
    size: int = eqx.field(static=True)

    def __init__(self, fn, width):
        self.fn = fn
        self.size = width

    def __call__(self, x):
        return self.fn(x)


@dataclasses.dataclass(frozen=True)
class Scaler:
    """A callable dataclass, rebuilt from its fields."""

    factor: float

    def __call__(self, x):
        return self.factor * x


@dataclasses.dataclass(eq=False)
class Opaque:
    """A dataclass compared by identity: a rebuilt copy is never equal to it."""

    size: int


class Step(eqx.Module):
    """A scan step holding an array: `carry <- weight * carry + x`."""

    weight: jax.Array
    label: zm.Static

    def __call__(self, carry, x):
        carry = self.weight * carry + x
        return carry, jnp.sum(carry)


def mlp(seed=0, width=8, dtype=None):
    model = eqx.nn.MLP(3, 2, width, 2, key=jax.random.key(seed))
    if dtype is not None:
        model = jax.tree_util.tree_map(lambda a: a.astype(dtype) if eqx.is_array(a) else a, model)
    return model


def mlp_skeleton(width=8):
    return eqx.filter_eval_shape(mlp, 0, width)


# --------------------------------------------------------------------------------------
# Fixtures and file utilities


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("serialise")


def split_file(data: bytes) -> tuple[bytes, dict, bytes]:
    end = data.index(b"\n", 72)
    return data[:72], json.loads(data[72:end]), data[end + 1 :]


def rewrite_header(path: Path, change: Callable[[dict], None]) -> None:
    """Edit the header and sign it again, as a different writer would."""
    _, header, payload = split_file(path.read_bytes())
    change(header)
    header_bytes = json.dumps(header, separators=(",", ":")).encode()
    digest = hashlib.sha256(header_bytes).hexdigest().encode()
    path.write_bytes(b"zodmem " + digest + b"\n" + header_bytes + b"\n" + payload)


def leftovers(directory: Path) -> list[str]:
    return [p.name for p in directory.iterdir() if p.name.endswith(".tmp")]


def round_trip(transform, path, like=None):
    zm.save(path, transform)
    return zm.load(path, like=like)


# --------------------------------------------------------------------------------------
# Round trips


def test_function_stack_round_trip(tmp_path):
    params = {"b": jnp.asarray(0.5), "w": jnp.arange(4.0)}
    data = jnp.linspace(-1.0, 1.0, 4)
    hessian = zm.BatchedHessian(quadratic, batch_size=2, checkpoint=True)
    loaded = round_trip(hessian, tmp_path / "hessian.zm")
    assert type(loaded) is zm.BatchedHessian
    assert loaded.fn is quadratic
    assert loaded.config == hessian.config
    flat = jnp.concatenate([params["b"][None], params["w"]])
    reference = eqx.filter_jit(jax.hessian(lambda v: quadratic({"b": v[0], "w": v[1:]}, data)))(
        flat
    )
    np.testing.assert_allclose(loaded(params, data), reference, rtol=1e-6)
    assert jnp.array_equal(loaded(params, data), hessian(params, data))


def test_hessian_of_model_loss_round_trip(tmp_path, float64):
    model = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(1))
    model = jax.tree_util.tree_map(lambda a: a.astype(jnp.float64) if eqx.is_array(a) else a, model)
    xs = jnp.linspace(-1.0, 1.0, 12).reshape(4, 3)
    ys = jnp.ones((4, 2))
    hessian = zm.BatchedHessian(model_loss, nbatches=3)
    loaded = round_trip(hessian, tmp_path / "h.zm")
    assert loaded.fn is model_loss and loaded.nbatches == 3
    assert jnp.array_equal(loaded(model, xs, ys), hessian(model, xs, ys))


@eqx.filter_jit  # one program for every parametrisation below
def per_example_jacobians(model, xs):
    return jax.vmap(jax.jacrev(model))(xs)


@pytest.mark.parametrize("like_form", ["module", "stack", "concrete"])
def test_model_inside_transform_inside_transform(tmp_path, like_form):
    model = mlp(2)
    stack = zm.ChunkedVmap(zm.BatchedJacobian(model, mode="rev"), chunk_size=3)
    like = {
        "module": mlp_skeleton(),
        "stack": zm.ChunkedVmap(zm.BatchedJacobian(mlp_skeleton()), chunk_size=1),
        "concrete": mlp(seed=7),
    }[like_form]
    loaded = round_trip(stack, tmp_path / "stack.zm", like=like)
    assert type(loaded) is zm.ChunkedVmap and type(loaded.fn) is zm.BatchedJacobian
    assert loaded.chunk_size == 3 and loaded.fn.mode == "rev"
    assert bool(eqx.tree_equal(loaded, stack))
    xs = jnp.linspace(-2.0, 2.0, 15).reshape(5, 3)
    np.testing.assert_allclose(loaded(xs), per_example_jacobians(model, xs), rtol=1e-5, atol=1e-6)
    assert jnp.array_equal(loaded(xs), stack(xs))


def test_two_modules_need_a_mirrored_like(tmp_path):
    stack = TwoModels(mlp(3), eqx.nn.Linear(3, 2, key=jax.random.key(4)))
    like = TwoModels(
        mlp_skeleton(), eqx.filter_eval_shape(eqx.nn.Linear, 3, 2, key=jax.random.key(0))
    )
    loaded = round_trip(stack, tmp_path / "two.zm", like=like)
    assert bool(eqx.tree_equal(loaded, stack))
    with pytest.raises(zm.SerialisationError, match=r"holds 2 Equinox modules"):
        zm.load(tmp_path / "two.zm", like=mlp_skeleton())


def test_importable_callables_as_fn(tmp_path):
    for fn in (jnp.sin, jitted_scale, filter_jitted_scale, functools.partial(scale, factor=3.0)):
        loaded = round_trip(zm.ChunkedVmap(fn, chunk_size=2), tmp_path / "f.zm")
        x = jnp.arange(5.0)
        assert jnp.array_equal(loaded(x), jax.vmap(fn)(x))
    assert round_trip(zm.ChunkedVmap(jnp.sin, chunk_size=2), tmp_path / "f.zm").fn is jnp.sin


def test_chunked_vmap_axes_round_trip(tmp_path):
    vmapped = zm.ChunkedVmap(jnp.outer, chunk_size=2, in_axes=(eqx.if_array(1), None), out_axes=-1)
    loaded = round_trip(vmapped, tmp_path / "v.zm")
    assert loaded.in_axes == (eqx.if_array(1), None) and loaded.out_axes == -1
    a, b = jnp.arange(20.0).reshape(4, 5), jnp.arange(3.0)
    expected = eqx.filter_vmap(jnp.outer, in_axes=(1, None), out_axes=-1)(a, b)
    assert jnp.array_equal(loaded(a, b), expected)
    assert round_trip(zm.ChunkedVmap(scale, chunk_size=4), tmp_path / "d.zm").in_axes == (
        eqx.if_array(0)
    )


def test_microbatcher_round_trip(tmp_path):
    w = jnp.asarray([0.5, -1.0, 2.0])
    xs, ys = jnp.arange(21.0).reshape(7, 3) / 10, jnp.arange(7.0)

    def reference_loss(w, x, y):
        return jnp.mean((x @ w - y) ** 2)

    summed = zm.Accumulator(init=zeros_like_shape, update=add_update, finalize=identity)
    cases = [
        zm.Microbatcher(
            jax.grad(model_loss_linear),
            microbatch_size=3,
            argnums=[1, 2],
            accumulator=zm.AccumulationType.MEAN,
        ),
        zm.Microbatcher(
            zm.BatchedHessian(model_loss_linear),
            microbatch_size=2,
            argnums=(1, 2),
            accumulator="mean",
        ),
        zm.Microbatcher(
            model_loss_linear,
            microbatch_size=3,
            argnums=(1, 2),
            accumulator=summed,
            num_real_microbatches=jnp.asarray(2),
        ),
    ]
    expected = jax.jit(  # one program for the three answers
        lambda w, xs, ys: [
            jax.grad(reference_loss)(w, xs, ys),
            jax.hessian(reference_loss)(w, xs, ys),
            reference_loss(w, xs[:3], ys[:3]) + reference_loss(w, xs[3:6], ys[3:6]),
        ]
    )(w, xs, ys)
    for i, (microbatcher, answer) in enumerate(zip(cases, expected, strict=True)):
        if i == 0:
            # jax.grad returns a closure, which cannot be imported.
            with pytest.raises(zm.SerialisationError, match=r"`transform\.fn`.*jax\.grad"):
                zm.save(tmp_path / "m.zm", microbatcher)
            continue
        loaded = round_trip(microbatcher, tmp_path / "m.zm")
        assert loaded.config == microbatcher.config
        assert jnp.array_equal(loaded(w, xs, ys), microbatcher(w, xs, ys))
        np.testing.assert_allclose(loaded(w, xs, ys), answer, rtol=1e-5)
    loaded = zm.load(tmp_path / "m.zm")
    assert isinstance(loaded.num_real_microbatches, jax.Array)
    assert int(loaded.num_real_microbatches) == 2
    assert loaded.accumulator == summed


def model_loss_linear(w, x, y):
    return jnp.mean((x @ w - y) ** 2)


def test_scans_round_trip(tmp_path):
    xs = jnp.linspace(0.0, 1.0, 10)
    _, plain_ys = jax.lax.scan(scan_step, jnp.asarray(1.0), xs, reverse=True)
    sliced = zm.SlicedScan(scan_step, start=1, stop=9, step=3, reverse=True, unroll=2)
    loaded = round_trip(sliced, tmp_path / "s.zm")
    assert loaded.config == sliced.config
    carry, ys = loaded(jnp.asarray(1.0), xs)
    assert jnp.array_equal(ys, plain_ys[1:9:3])

    step = Step(jnp.asarray([0.5, 0.25]), zm.Static("decay"))
    checkpointed = zm.CheckpointedScan(step, chunk_size=3, length=10)
    skeleton = Step(jnp.zeros(2), zm.Static("decay"))
    loaded = round_trip(checkpointed, tmp_path / "c.zm", like=skeleton)
    assert bool(eqx.tree_equal(loaded, checkpointed))
    assert loaded.fn.label == zm.Static("decay")

    checkpointed = zm.CheckpointedScan(scan_step, chunk_size=4, unroll=True)
    loaded = round_trip(checkpointed, tmp_path / "c.zm")
    assert loaded.config == checkpointed.config
    expected = jax.lax.scan(scan_step, jnp.asarray(1.0), xs)
    assert bool(eqx.tree_equal(loaded(jnp.asarray(1.0), xs), expected))


def test_scan_of_loaded_step_module(tmp_path):
    step = Step(jnp.asarray([0.5, 0.25]), zm.Static("decay"))
    checkpointed = zm.CheckpointedScan(step, chunk_size=3)
    loaded = round_trip(checkpointed, tmp_path / "c.zm", like=step)
    xs = jnp.stack([jnp.linspace(0.0, 1.0, 10), -jnp.linspace(0.0, 1.0, 10)], axis=1)
    expected = jax.lax.scan(lambda carry, x: step(carry, x), jnp.zeros(2), xs)
    assert bool(eqx.tree_equal(loaded(jnp.zeros(2), xs), expected))


def test_load_runs_each_constructor_once(tmp_path):
    path = tmp_path / "c.zm"
    stack = Counted(Counted(mlp()))
    zm.save(path, stack)
    Counted.built.clear()
    loaded = zm.load(path, like=mlp_skeleton())
    assert Counted.built == ["MLP", "Counted"]
    assert bool(eqx.tree_equal(loaded, stack))


def test_static_values_round_trip(tmp_path):
    for value in (zm.Static("double"), zm.Static((1, 2)), (zm.Static(None), zm.Static(3.5))):
        loaded = round_trip(Probe(scale, option=value), tmp_path / "p.zm")
        assert loaded.option == value


# --------------------------------------------------------------------------------------
# Wrappers found where their name is bound


@pytest.mark.parametrize("name", ["grad_loss", "jitted_loss"])
def test_wrapper_bound_in_another_module(tmp_path, name):
    wrapper = getattr(serialise_wrapped, name)
    path = tmp_path / "w.zm"
    loaded = round_trip(zm.ChunkedVmap(wrapper, chunk_size=4), path)
    assert loaded.fn is wrapper
    assert split_file(path.read_bytes())[1]["stack"]["children"]["fn"] == {
        "kind": "value",
        "value": {"type": "import", "path": f"serialise_wrapped:{name}"},
    }
    x = jnp.linspace(-1.0, 1.0, 6)
    close(loaded(x), eqx.filter_jit(jax.vmap(wrapper))(x), rtol=1e-6, atol=1e-6)


def test_wrapper_bound_in_the_calling_module(tmp_path):
    path = tmp_path / "w.zm"
    loaded = round_trip(zm.BatchedJacobian(grad_of_other, nbatches=2), path)
    assert loaded.fn is grad_of_other
    fn = split_file(path.read_bytes())[1]["stack"]["children"]["fn"]
    assert fn["value"]["path"] == f"{__name__}:grad_of_other"
    x = jnp.linspace(-1.0, 1.0, 4)
    close(loaded(x), eqx.filter_jit(jax.jacrev(grad_of_other))(x), rtol=1e-6, atol=1e-6)


def test_wrapper_loads_in_a_fresh_process(tmp_path):
    path = tmp_path / "w.zm"
    zm.save(path, zm.ChunkedVmap(serialise_wrapped.grad_loss, chunk_size=4))
    tests = Path(__file__).resolve().parent
    code = (
        f"import sys; sys.path.insert(0, {str(tests)!r}); import serialise_wrapped, zodmem; "
        f"print(zodmem.load({str(path)!r}).fn is serialise_wrapped.grad_loss)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tests.parent, capture_output=True, text=True
    )
    assert result.stdout.strip() == "True", result.stderr[-2000:]


# --------------------------------------------------------------------------------------
# Static values: a sweep of everything the encoding describes


importable_values = st.sampled_from(
    [
        quadratic,
        scale,
        jnp.sin,
        jitted_scale,
        filter_jitted_scale,
        Colour,
        Pair,
        eqx.if_array(1),
        functools.partial(scale, factor=0.5),
        functools.partial(functools.partial(scale), 1.0),
        zm.AccumulationType.CONCAT,
        jnp.dtype("float32"),
        jnp.dtype("bfloat16"),
        zm.Accumulator(init=zeros_like_shape, update=add_update, finalize=identity),
        zm.Static("x"),
    ]
)
scalar_values = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.complex_numbers(allow_nan=True)
    | st.text(max_size=8)
    | st.sampled_from(list(Colour) + list(Level))
    | importable_values
)
static_values = st.recursive(
    scalar_values,
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.lists(inner, max_size=3).map(tuple)
        | st.builds(Pair, inner, inner)
        | st.dictionaries(st.text(max_size=4), inner, max_size=3)
        | st.dictionaries(st.integers(), inner, max_size=3)
        | st.builds(functools.partial, st.just(scale), inner)
    ),
    max_leaves=8,
)


def described(value):
    """A comparison key: type and repr all the way down (repr tells NaN apart too)."""
    if isinstance(value, (tuple, list)):
        return (type(value), [described(v) for v in value])
    if isinstance(value, dict):
        return (dict, [(described(k), described(v)) for k, v in value.items()])
    if isinstance(value, functools.partial):
        return (
            type(value),
            described(value.func),
            described(value.args),
            described(value.keywords),
        )
    return (type(value), repr(value))


@given(value=static_values)
def test_static_value_sweep(workdir, value):
    loaded = round_trip(Probe(scale, option=value), workdir / "sweep.zm")
    assert described(loaded.option) == described(value)


def test_enum_members_and_types_are_exact(tmp_path):
    value = (Level.HIGH, Colour.BLUE, 1, True, 1.0, -0.0, float("nan"), 2**80, "ü")
    loaded = round_trip(Probe(scale, option=value), tmp_path / "e.zm").option
    assert [type(v) for v in loaded] == [type(v) for v in value]
    assert loaded[0] is Level.HIGH and loaded[1] is Colour.BLUE
    assert str(loaded[5]) == "-0.0" and np.isnan(loaded[6]) and loaded[7] == 2**80


# --------------------------------------------------------------------------------------
# Refusals at save time


def test_refuses_lambda_fn(tmp_path):
    with pytest.raises(zm.SerialisationError, match=r"`transform\.fn`.*lambda"):
        zm.save(tmp_path / "x.zm", zm.BatchedHessian(lambda x: jnp.sum(x**2)))
    assert not (tmp_path / "x.zm").exists()


def test_refuses_closure_and_local_function(tmp_path):
    def local(x):
        return x

    with pytest.raises(zm.SerialisationError, match=r"`transform\.fn\.fn`.*inside a function"):
        zm.save(tmp_path / "x.zm", zm.ChunkedVmap(zm.BatchedJacobian(local), chunk_size=2))
    with pytest.raises(zm.SerialisationError, match=r"`transform\.fn`.*does not give this"):
        zm.save(tmp_path / "x.zm", zm.BatchedJacobian(jax.grad(quadratic)))


@pytest.mark.filterwarnings("ignore:A JAX array is being set as static")
@pytest.mark.parametrize(
    ("value", "inner", "reason"),
    [
        (lambda x: 0, r"", r"lambda"),
        ((0, lambda x: 0), r"\(at `option\[1\]`\)", r"lambda"),
        ({"a": functools.partial(lambda x: x)}, r"\(at `option\['a'\]\.func`\)", r"lambda"),
        (object(), r"", r"neither a plain value"),
        (jnp.zeros(3), r"", r"is an array"),
        (np.float32(1.0), r"", r"is an array"),
        (frozenset({1}), r"", r"neither a plain value"),
        (mlp_skeleton().__call__, r"", r"bound to an instance of MLP"),  # nothing to compile
    ],
)
def test_refuses_config_values(tmp_path, value, inner, reason):
    with pytest.raises(
        zm.SerialisationError, match=rf"(?s)`option` of Probe at `transform`.*{inner}.*{reason}"
    ):
        zm.save(tmp_path / "x.zm", Probe(scale, option=value))
    assert not (tmp_path / "x.zm").exists() and leftovers(tmp_path) == []


def test_callable_dataclass_as_fn(tmp_path):
    loaded = round_trip(zm.ChunkedVmap(Scaler(0.5), chunk_size=2), tmp_path / "d.zm")
    assert loaded.fn == Scaler(0.5)
    assert jnp.array_equal(loaded(jnp.arange(3.0)), jnp.arange(3.0) * 0.5)


def test_refuses_values_not_rebuilt_equal(tmp_path):
    with pytest.raises(zm.SerialisationError, match=r"`option` of Probe.*not described faithfully"):
        zm.save(tmp_path / "x.zm", Probe(scale, option=Opaque(3)))
    with pytest.raises(zm.SerialisationError, match=r"`transform\.fn`.*not described faithfully"):
        zm.save(tmp_path / "x.zm", Probe(Opaque(3)))


def test_refuses_chunked_vmap_lambda_axes(tmp_path):
    vmapped = zm.ChunkedVmap(scale, chunk_size=2, in_axes=(lambda leaf: 0,))
    with pytest.raises(zm.SerialisationError, match=r"`in_axes` of ChunkedVmap.*lambda"):
        zm.save(tmp_path / "x.zm", vmapped)


def test_refuses_bound_method_fn(tmp_path):
    with pytest.raises(
        zm.SerialisationError, match=r"bound to an instance of MLP.*instance itself"
    ):
        zm.save(tmp_path / "x.zm", zm.BatchedJacobian(mlp().__call__))


def test_refuses_transform_that_cannot_be_rebuilt(tmp_path):
    with pytest.raises(zm.SerialisationError, match=r"Rebuilt cannot be rebuilt from its fields"):
        zm.save(tmp_path / "x.zm", Rebuilt(scale, 3))


def test_module_fn_of_a_local_class(tmp_path):
    class Scale(eqx.Module):
        weight: jax.Array

        def __call__(self, x):
            return self.weight * x

    path = tmp_path / "local.zm"
    transform = zm.ChunkedVmap(Scale(jnp.arange(3.0)), chunk_size=2)
    zm.save(path, transform)
    with pytest.raises(
        zm.SerialisationError, match=r"`transform\.fn` \(.*<locals>\.Scale\).*`like`"
    ):
        zm.load(path)
    with pytest.raises(zm.SerialisationError, match=r"disagrees with the file at `transform\.fn`"):
        zm.load(path, like=mlp_skeleton())
    loaded = zm.load(path, like=Scale(jnp.zeros(3)))
    close(loaded, transform, exact=True)
    xs = jnp.linspace(-1.0, 1.0, 15).reshape(5, 3)
    close(loaded(xs), transform(xs), exact=True)


SCRIPT = """
import equinox as eqx
import jax
import jax.numpy as jnp
import zodmem as zm


class Model(eqx.Module):
    weight: jax.Array

    def __call__(self, x):
        return self.weight * x


zm.save(PATH, zm.ChunkedVmap(Model(jnp.arange(3.0)), chunk_size=2))
"""


def test_module_fn_of_a_class_from_a_script(tmp_path):
    script, path = tmp_path / "script.py", tmp_path / "script.zm"
    script.write_text(SCRIPT)
    namespace = runpy.run_path(str(script), init_globals={"PATH": path}, run_name="__main__")
    with pytest.raises(zm.SerialisationError, match=r"`transform\.fn` \(__main__:Model\).*`like`"):
        zm.load(path)
    loaded = zm.load(path, like=namespace["Model"](jnp.zeros(3)))
    assert type(loaded.fn) is namespace["Model"]
    close(loaded.fn.weight, jnp.arange(3.0), exact=True)


def test_refuses_non_transform(tmp_path):
    # The annotation is checked first when the package runs under beartype.
    with pytest.raises(Exception, match=r"saves zodmem transforms|AbstractTransform"):
        zm.save(tmp_path / "x.zm", mlp())
    with pytest.raises(zm.SerialisationError, match=r"saves zodmem transforms"):
        inspect.unwrap(serialise.save)(tmp_path / "x.zm", mlp())


def test_serialisation_error_is_value_error():
    assert issubclass(zm.SerialisationError, ValueError)


# --------------------------------------------------------------------------------------
# Damaged files


@pytest.fixture
def saved_stack(tmp_path):
    path = tmp_path / "stack.zm"
    zm.save(path, zm.ChunkedVmap(zm.BatchedJacobian(mlp(5)), chunk_size=2))
    return path


def test_file_layout(saved_stack):
    first_line, header, payload = split_file(saved_stack.read_bytes())
    assert first_line.startswith(b"zodmem ") and first_line.endswith(b"\n")
    assert header["format"] == "zodmem.transform" and header["version"] == 1
    assert header["stack"]["class"] == "zodmem:ChunkedVmap"
    assert header["stack"]["children"]["fn"]["children"]["fn"] == {
        "kind": "module",
        "class": "equinox.nn:MLP",
    }
    assert header["leaves"][0] == {
        "path": ".fn.fn.layers[0].weight",
        "shape": [8, 3],
        "dtype": "float32",
    }
    assert header["payload"]["bytes"] == len(payload)


def test_byte_flips_are_detected(saved_stack):
    data = saved_stack.read_bytes()
    header_end = data.index(b"\n", 72)
    positions = [0, 3, 6, 7, 40, 71, 72, 100, (72 + header_end) // 2, header_end - 1]
    positions += [header_end, header_end + 1, header_end + 200, (header_end + len(data)) // 2]
    positions += [len(data) - 1]
    for position in positions:
        for mask in (0x01, 0xFF):
            damaged = bytearray(data)
            damaged[position] ^= mask
            saved_stack.write_bytes(bytes(damaged))
            with pytest.raises(zm.SerialisationError, match=r"corrupted"):
                zm.load(saved_stack, like=mlp_skeleton())


def test_truncations_are_detected(saved_stack):
    data = saved_stack.read_bytes()
    header_end = data.index(b"\n", 72)
    lengths = [0, 1, 6, 7, 50, 71, 72, 73, (72 + header_end) // 2, header_end, header_end + 1]
    lengths += [header_end + 100, (header_end + len(data)) // 2, len(data) - 1]
    for length in lengths:
        saved_stack.write_bytes(data[:length])
        with pytest.raises(zm.SerialisationError, match=r"truncated or corrupted"):
            zm.load(saved_stack, like=mlp_skeleton())


def test_trailing_bytes_are_detected(saved_stack):
    saved_stack.write_bytes(saved_stack.read_bytes() + b"\0")
    with pytest.raises(zm.SerialisationError, match=r"1 bytes after"):
        zm.load(saved_stack, like=mlp_skeleton())


def test_not_a_zodmem_file(tmp_path):
    path = tmp_path / "model.eqx"
    eqx.tree_serialise_leaves(path, mlp())
    with pytest.raises(zm.SerialisationError, match=r"not a zodmem file"):
        zm.load(path, like=mlp_skeleton())


def test_unknown_format_version(saved_stack):
    rewrite_header(saved_stack, lambda header: header.update(version=2))
    with pytest.raises(zm.SerialisationError, match=r"format version 2 .* reads version 1"):
        zm.load(saved_stack, like=mlp_skeleton())


def test_unknown_format_name(saved_stack):
    rewrite_header(saved_stack, lambda header: header.update(format="other"))
    with pytest.raises(zm.SerialisationError, match=r"format is 'other'"):
        zm.load(saved_stack, like=mlp_skeleton())


@pytest.mark.parametrize(
    ("path", "message"),
    [
        ("zodmem:NoSuchTransform", r"has no `NoSuchTransform`"),
        (
            "no_such_module_for_zodmem:ChunkedVmap",
            r"`no_such_module_for_zodmem` cannot be imported",
        ),
        ("zodmem:Static", r"not a subclass of .*AbstractTransform"),
        ("not-a-path", r"malformed"),
    ],
)
def test_class_that_cannot_be_found(saved_stack, path, message):
    rewrite_header(saved_stack, lambda header: header["stack"].update({"class": path}))
    with pytest.raises(zm.SerialisationError, match=message):
        zm.load(saved_stack, like=mlp_skeleton())


def test_model_class_that_cannot_be_found(saved_stack):
    def change(header):
        header["stack"]["children"]["fn"]["children"]["fn"]["class"] = "equinox.nn:NoModel"

    rewrite_header(saved_stack, change)
    with pytest.raises(zm.SerialisationError, match=r"has no `NoModel`"):
        zm.load(saved_stack, like=mlp_skeleton())


def test_function_that_cannot_be_found(tmp_path):
    path = tmp_path / "f.zm"
    zm.save(path, zm.BatchedHessian(quadratic))
    fn_value = ["stack", "children", "fn", "value", "path"]

    def point_to(target):
        def change(header):
            node = header
            for key in fn_value[:-1]:
                node = node[key]
            node["path"] = target

        return change

    rewrite_header(path, point_to(f"{__name__}:no_such_function"))
    with pytest.raises(zm.SerialisationError, match=r"has no `no_such_function`"):
        zm.load(path)
    rewrite_header(path, point_to("__main__:quadratic_from_a_script"))
    with pytest.raises(zm.SerialisationError, match=r"module `__main__`"):
        zm.load(path)


def test_configuration_rejected_by_constructor(tmp_path):
    path = tmp_path / "h.zm"
    zm.save(path, zm.BatchedHessian(quadratic, nbatches=2))
    rewrite_header(path, lambda h: h["stack"]["config"]["nbatches"].update(value="-3"))
    with pytest.raises(zm.SerialisationError, match=r"rejected by its constructor.*nbatches"):
        zm.load(path)
    zm.save(path, zm.BatchedHessian(quadratic, nbatches=2))
    rewrite_header(path, lambda h: h["stack"]["config"].update(nbatches={"type": "mystery"}))
    with pytest.raises(
        zm.SerialisationError,
        match=r"^The file's value for `transform\.nbatches` \(of BatchedHessian\) has unknown "
        r"type tag 'mystery'\.$",
    ):
        zm.load(path)
    zm.save(path, zm.BatchedHessian(quadratic, nbatches=2))
    rewrite_header(path, lambda h: h["stack"]["children"]["fn"].update(kind="other"))
    with pytest.raises(zm.SerialisationError, match=r"malformed"):
        zm.load(path)


def test_sharding_over_more_devices_than_present(tmp_path):
    path = tmp_path / "h.zm"
    mesh = jax.make_mesh((1,), ("d",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d", None))
    zm.save(path, zm.BatchedHessian(quadratic, sharding=sharding))

    def ask_for_more(header):
        header["stack"]["config"]["sharding"]["axis_sizes"] = [64]

    rewrite_header(path, ask_for_more)
    with pytest.raises(zm.SerialisationError) as error:
        zm.load(path)
    message = str(error.value)
    assert message.startswith(
        "The file's `transform.sharding` (of BatchedHessian) is a sharding over a mesh of "
        f"64 devices ('d': 64), but only {len(jax.devices())} "
    )
    assert "Load it where at least 64 devices are present." in message
    # Every code span opens and closes with nothing nested inside it.
    assert message.count("`") % 2 == 0 and "``" not in message
    assert all(" " not in span for span in message.split("`")[1::2])


def test_stack_that_is_not_a_transform(tmp_path):
    path = tmp_path / "h.zm"
    zm.save(path, zm.BatchedHessian(quadratic))
    rewrite_header(path, lambda h: h.update(stack={"kind": "value", "value": {"type": "none"}}))
    with pytest.raises(zm.SerialisationError, match=r"malformed: its stack is not a transform"):
        zm.load(path)


# --------------------------------------------------------------------------------------
# `like` that disagrees with the file


@pytest.mark.parametrize(
    ("like", "message"),
    [
        (None, r"Equinox modules at `transform\.fn\.fn` \(equinox\.nn:MLP\).*`like`"),
        (
            eqx.nn.Linear(3, 2, key=jax.random.key(0)),
            r"file holds a equinox\.nn:MLP, `like` a .*Linear",
        ),
        (mlp_skeleton(width=4), r"`\.fn\.fn\.layers\[0\]\.weight`.*\(8, 3\).*\(4, 3\)"),
        (
            eqx.filter_eval_shape(mlp, 0, 8, jnp.float16),  # a skeleton: nothing to compile
            r"dtype float32, `like` an array of shape \(8, 3\) and dtype float16",
        ),
        (zm.BatchedJacobian(mlp_skeleton()), r"the file holds a zodmem:ChunkedVmap, `like` a"),
        (zm.ChunkedVmap(zm.BatchedJacobian(scale), chunk_size=2), r"file holds a equinox.nn:MLP"),
        ({"fn": mlp_skeleton()}, r"`like` must be None, an Equinox module or a zodmem transform"),
    ],
)
def test_like_that_disagrees(saved_stack, like, message):
    with pytest.raises(zm.SerialisationError, match=message):
        zm.load(saved_stack, like=like)


def test_like_for_a_stack_without_modules(tmp_path):
    path = tmp_path / "h.zm"
    zm.save(path, zm.BatchedHessian(quadratic))
    with pytest.raises(zm.SerialisationError, match=r"holds 0 Equinox modules"):
        zm.load(path, like=mlp_skeleton())
    assert zm.load(path, like=zm.BatchedHessian(scale)).fn is quadratic


# --------------------------------------------------------------------------------------
# Atomic replacement


def test_save_replaces_an_existing_file(tmp_path):
    path = tmp_path / "t.zm"
    zm.save(path, zm.BatchedHessian(quadratic, nbatches=2))
    os.chmod(path, 0o640)
    zm.save(path, zm.BatchedHessian(quadratic, nbatches=3))
    assert zm.load(path).nbatches == 3
    assert os.stat(path).st_mode & 0o777 == 0o640
    assert leftovers(tmp_path) == []
    zm.save(str(path), zm.BatchedHessian(quadratic, nbatches=5))
    assert zm.load(str(path)).nbatches == 5


class _FailingFile:
    """Writes half of the second chunk, then fails as a full disk would."""

    def __init__(self, file):
        self.file, self.calls = file, 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.file.__exit__(*exc)

    def write(self, chunk):
        self.calls += 1
        if self.calls == 2:
            self.file.write(chunk[: len(chunk) // 2])
            self.file.flush()
            raise OSError(28, "No space left on device")
        return self.file.write(chunk)

    def __getattr__(self, name):
        return getattr(self.file, name)


def _fail_fsync(descriptor):
    raise OSError(5, "Input/output error")


def _fail_replace(source, destination):
    raise OSError(5, "Input/output error")


@pytest.mark.parametrize("failure", ["write", "fsync", "replace"])
def test_failed_save_keeps_the_old_file(tmp_path, monkeypatch, failure):
    path = tmp_path / "t.zm"
    zm.save(path, zm.BatchedHessian(quadratic, nbatches=2))
    before = path.read_bytes()
    fdopen = os.fdopen
    with monkeypatch.context() as patch:
        if failure == "write":
            patch.setattr(os, "fdopen", lambda *a, **k: _FailingFile(fdopen(*a, **k)))
        elif failure == "fsync":
            patch.setattr(os, "fsync", _fail_fsync)
        else:
            patch.setattr(os, "replace", _fail_replace)
        with pytest.raises(OSError, match=r"No space left|Input/output error"):
            zm.save(path, zm.ChunkedVmap(zm.BatchedJacobian(mlp()), chunk_size=4))
        with pytest.raises(OSError):
            zm.save(tmp_path / "new.zm", zm.BatchedHessian(quadratic))
    assert path.read_bytes() == before
    assert zm.load(path).nbatches == 2
    assert leftovers(tmp_path) == [] and not (tmp_path / "new.zm").exists()


def test_failed_save_names_the_users_path(tmp_path, monkeypatch):
    path = tmp_path / "no_such_directory" / "t.zm"
    with pytest.raises(FileNotFoundError) as missing:
        zm.save(path, zm.BatchedHessian(quadratic))
    assert missing.value.filename == str(path) and ".tmp" not in str(missing.value)

    def refuse_replace(source, destination):
        raise PermissionError(errno.EACCES, "Permission denied", source, None, destination)

    path = tmp_path / "t.zm"
    monkeypatch.setattr(os, "replace", refuse_replace)
    with pytest.raises(PermissionError) as refused:
        zm.save(path, zm.BatchedHessian(quadratic))
    assert str(refused.value) == f"[Errno {errno.EACCES}] Permission denied: {str(path)!r}"
    assert leftovers(tmp_path) == [] and not path.exists()


@pytest.mark.skipif(
    os.name != "posix" or os.geteuid() == 0, reason="root may write into read-only directories"
)
def test_save_into_a_read_only_directory_names_the_users_path(tmp_path):
    directory = tmp_path / "read_only"
    directory.mkdir()
    directory.chmod(0o500)
    try:
        with pytest.raises(PermissionError) as refused:
            zm.save(directory / "t.zm", zm.BatchedHessian(quadratic))
    finally:
        directory.chmod(0o700)
    assert refused.value.filename == str(directory / "t.zm")


# --------------------------------------------------------------------------------------
# The example


def test_example_runs(capsys):
    runpy.run_path(str(EXAMPLE), run_name="__main__")
    assert "identical" in capsys.readouterr().out


def test_public_classes_are_saved_by_their_public_paths():
    """A loss is found again as `zodmem.losses:...`, a transform as `zodmem:...`: public
    paths, which survive moves between private modules."""
    from zodmem._serialise._import_path import import_path, resolve

    assert import_path(zm.losses.SquaredError)[0] == "zodmem.losses:SquaredError"
    assert import_path(zm.BatchedGGN)[0] == "zodmem:BatchedGGN"
    assert resolve("zodmem.losses:SquaredError", "a loss") is zm.losses.SquaredError
    assert resolve("zodmem:BatchedHessian", "a transform") is zm.BatchedHessian
