"""The checks that every transform and compat function makes on what it is given.

One convention for every message: it starts with the owner, names the argument, shows
the value and says what is allowed. The owner is what the user called: a class gives its
name through `_owner` (`NamedInMessages`; `f"{self._owner}.solve"` for a method) and a
public function its `zm.` name, set once at its top (a compat function, the peer's
name); either passes it on to the checks and helpers as `owner=`. Integer options are
read with `operator.index`, so NumPy integers are welcome and floats and bools are
refused. A value is shown by its `repr` and its type's full name (`numpy.float64`, not
`float64`), so that NumPy's scalars, whose short names repeat Python's (`numpy.bool`
is not `bool`), are told apart.

The public functions and methods of the estimators and operators declare their
arguments' types (`Integer`, `Number`, `RealScalar`, `Memory`, jaxtyping's arrays) and
are wrapped in `typechecked`, which checks them at every call; the checks here are for
what a type cannot say (a range, a choice among strings) and for words that say more.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import operator
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeAlias, TypeVar, no_type_check

import equinox as eqx
import jax
import numpy as np
from jaxtyping import Array, Real, TypeCheckError, jaxtyped

from ._traceback import public

__all__ = [
    "NamedInMessages",
    "Integer",
    "Memory",
    "Number",
    "RealScalar",
    "checked_annotations",
    "typechecked",
    "typechecked_constructor",
    "as_index",
    "as_int_or_bool",
    "int_option",
    "memory_option",
    "check_bool",
    "check_callable",
    "check_choice",
    "check_int",
    "check_block_options",
    "common_size",
    "described",
    "refuses_forward_mode",
    "taking_jvps_of_fn",
]


class NamedInMessages(eqx.Module):
    """A class whose messages name it: `_owner`, its class's name, which its methods
    give the checks and helpers they call as `owner=` (`f"{self._owner}.solve"` for a
    method's). The planned work of `zodmem._plan` names itself the same way."""

    @property
    def _owner(self) -> str:
        return type(self).__name__


# -- the types of public arguments, checked at every call ----------------------------------

Integer: TypeAlias = int | np.integer
"""An integer option: a Python or a NumPy int."""
Number: TypeAlias = int | float | np.integer | np.floating
"""A real number given as a Python or a NumPy scalar."""
RealScalar: TypeAlias = Number | Real[Array, ""]
"""A real number, also as a 0-d JAX array (traced too, under `jax.jit`)."""
Memory: TypeAlias = int | np.integer | str | None
"""A memory budget: bytes, a size with a unit (`"750MB"`), `"auto"`, or none."""

_Function = TypeVar("_Function", bound=Callable[..., Any])
_Class = TypeVar("_Class", bound=type)
_PARAMETER = re.compile(r"typechecking parameter '(\w+)'")


def checked_annotations(function: _Function) -> _Function:
    """`jaxtyping.jaxtyped(typechecker=beartype)(function)`, built at its first call: the
    checker is made (and beartype imported) when the function is first used, not when
    zodmem is imported."""
    checked: list[Callable[..., Any]] = []

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        if not checked:
            from beartype import beartype

            checked.append(jaxtyped(typechecker=beartype)(function))
        return checked[0](*args, **kwargs)

    return call  # type: ignore[return-value]


def typechecked(function: _Function) -> _Function:
    """`function` with its annotations checked by beartype at every call, through
    jaxtyping (array dtypes and shapes, tracers under `jax.jit` too), as the transforms'
    `__call__`s are: a wrong type raises a `TypeError` that names the parameter.

    Where the function's own checks word the refusal better (what is allowed, what to do
    instead), their message is raised in its place: the call is then traced abstractly
    (`eqx.filter_eval_shape`, so nothing is computed; a constructor, which computes
    nothing, is run with its `__check_init__`), and a `TypeError` or `ValueError` whose
    message names the parameter is raised instead.
    """
    checked = checked_annotations(function)
    # The function itself, beneath `public` and any other checking wrapper.
    body = inspect.unwrap(function)
    name = f"{body.__module__}.{body.__qualname__}"
    checking = (f"the parameters of {name}", f"the return value of {name}")

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        try:
            return checked(*args, **kwargs)
        except TypeCheckError as error:
            if not any(what in str(error) for what in checking):
                raise
            found = _PARAMETER.search(str(error))
            explained = _explained(body, args, kwargs, found.group(1) if found else None)
            if explained is None:
                raise
            raise explained from None

    # A mark that outer wrappers copy (`functools.wraps`), for the tests to find.
    call._typechecked = True  # type: ignore[attr-defined]
    return call  # type: ignore[return-value]


def _explained(body: Callable, args: tuple, kwargs: dict, name: str | None) -> Exception | None:
    """The refusal that `body`'s own checks make of the arguments, where it names the
    parameter `name` (`None`: any of its parameters); `None` where they make none."""
    try:
        if body.__name__ == "__init__":
            # A constructor computes nothing: run, with what Equinox runs after it.
            body(*args, **kwargs)
            _converted_and_checked(args[0])
        else:
            eqx.filter_eval_shape(body, *args, **kwargs)
    except Exception as error:
        # The house's messages name a parameter as `name` (or an entry, `name[...]`); where
        # beartype's words name none (it checks one item of a container, drawn at random),
        # any of the call's parameters. Any other failure leaves beartype's words.
        names = [name] if name is not None else list(inspect.signature(body).parameters)
        named = any(re.search(rf"`{n}[`\[]", str(error)) for n in names)
        if isinstance(error, (TypeError, ValueError)) and named:
            return error
    return None


def _converted_and_checked(module: eqx.Module) -> None:
    """What Equinox does to a module once its constructor has run: each field through its
    converter, then every class's `__check_init__`, the module's own class first."""
    for field in dataclasses.fields(module):
        converter = field.metadata.get("converter")
        if converter is not None:
            object.__setattr__(module, field.name, converter(getattr(module, field.name)))
    for cls in type(module).__mro__:
        check = cls.__dict__.get("__check_init__")
        if check is not None:
            check(module)


def typechecked_constructor(cls: _Class) -> _Class:
    """`cls`, an Equinox module whose constructor the dataclass writes from its fields,
    with that constructor checked as `typechecked` checks a function.

    A parameter's type is its field's annotation, or, for a field with a converter, the
    annotation of the converter's parameter (as Equinox reads it): what the caller may
    give, before it is converted. The annotations are resolved here, each in its own
    module, so that beartype reads types rather than strings. The class is marked
    `__no_type_check__`, so that jaxtyping's import hook does not check the constructor a
    second time, first, in its own words.
    """
    init = cls.__init__
    for field in dataclasses.fields(cls):
        if field.name in init.__annotations__:
            init.__annotations__[field.name] = _given_type(cls, field)
    cls.__init__ = public(typechecked(init))
    cls.__no_type_check__ = True
    return cls


def _given_type(cls: type, field: dataclasses.Field) -> Any:
    """The type of what the caller gives for `field` of `cls`: its converter's parameter's
    annotation, or the field's own (from the class that declares it)."""
    converter = field.metadata.get("converter")
    if converter is not None:
        parameter = next(iter(inspect.signature(converter).parameters))
        return inspect.get_annotations(converter, eval_str=True)[parameter]
    owner = next(kind for kind in cls.__mro__ if field.name in inspect.get_annotations(kind))
    return inspect.get_annotations(owner, eval_str=True)[field.name]


def as_index(value: Any) -> Any:
    """`value` as a Python int when it is an integer (a NumPy integer included) and not a
    bool; anything else unchanged, for the checks to refuse with a clear message.

    Used as the converter of integer fields, so that `np.int64(8)` is stored, hashed
    and serialised as the Python int `8`.
    """
    if isinstance(value, bool) or value is None:
        return value
    try:
        return operator.index(value)
    except TypeError:
        return value


# The converters of options below carry the option's type as their parameter's
# annotation, which Equinox gives the constructor's parameter (`typechecked_constructor`
# checks it there); they themselves pass on anything, for the checks to refuse in words.


@no_type_check
def int_option(value: Integer | None) -> Any:
    """The converter of an integer option that may be `None`: as `as_index` reads it."""
    return as_index(value)


@no_type_check
def memory_option(value: Memory) -> Any:
    """The converter of `max_memory`: bytes as a Python int, the rest as given."""
    return as_index(value)


@no_type_check
def as_int_or_bool(value: Integer | bool | np.bool_) -> Any:
    """`value` as a Python bool when it is a bool (a NumPy bool included), else as
    `as_index` reads it: the converter of options that, like `lax.scan`'s `unroll`,
    take an int or a bool."""
    if isinstance(value, np.bool_):
        return bool(value)
    return as_index(value)


def described(value: Any) -> str:
    """`value` and its type for a message: `np.True_ of type numpy.bool`, `2.0 of type
    float`."""
    if isinstance(value, jax.core.Tracer):  # traced: its shape and dtype are what is known
        return f"an array of shape {value.shape} and dtype {value.dtype}"
    kind = type(value)
    name = (
        kind.__qualname__
        if kind.__module__ == "builtins"
        else f"{kind.__module__}.{kind.__qualname__}"
    )
    return f"{value!r} of type {name}"


def _is_int(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def check_int(
    value: Any,
    name: str,
    *,
    owner: str,
    minimum: int | None = None,
    optional: bool = False,
    allowed: str | None = None,
) -> int | None:
    """Refuse anything but an integer (at least `minimum`; or `None` when `optional`).

    Returns the value as a Python int (or `None`). `allowed` words what is allowed in
    the message (by default derived from `minimum` and `optional`).
    """
    kind = {None: "an int", 0: "a non-negative int", 1: "a positive int"}.get(
        minimum, f"an int >= {minimum}"
    )
    if value is None and optional:
        return None
    if not _is_int(value):
        allowed_types = allowed or (f"{kind} or None" if optional else kind)
        raise TypeError(f"{owner}: `{name}` must be {allowed_types}, got {described(value)}.")
    value = operator.index(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{owner}: `{name}` must be {allowed or kind}, got {name}={value}.")
    return value


def check_callable(value: Any, name: str, *, owner: str) -> None:
    if not callable(value):
        raise TypeError(
            f"{owner}: `{name}` must be callable (a function or a module with __call__), "
            f"got {described(value)}."
        )


def check_bool(value: Any, name: str, *, owner: str) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{owner}: `{name}` must be True or False, got {described(value)}.")


def check_choice(value: Any, name: str, choices: Iterable[Any], *, owner: str) -> None:
    choices = tuple(choices)
    if not isinstance(value, str) or value not in choices:
        allowed = ", ".join(repr(c) for c in choices)
        raise ValueError(f"{owner}: `{name}` must be one of {allowed}; got {value!r}.")


def check_block_options(
    count: Any,
    size: Any,
    *,
    owner: str,
    count_name: str = "nbatches",
    size_name: str = "batch_size",
) -> None:
    """Validate a pair of ways to say a block size (`nbatches` / `batch_size`): each
    `None` or a positive int, and not both."""
    check_int(count, count_name, owner=owner, minimum=1, optional=True)
    check_int(size, size_name, owner=owner, minimum=1, optional=True)
    if count is not None and size is not None:
        raise ValueError(
            f"{owner}: give at most one of `{count_name}` and `{size_name}`, got "
            f"{count_name}={count} and {size_name}={size}."
        )


def common_size(
    sizes: Mapping[str, int], *, owner: str, what: str, subject: str = "the mapped inputs"
) -> int | None:
    """The one size that every input named in `sizes` shares along its mapped axis.

    `sizes` maps a description of each input (`"args[0]['w'] (axis 1)"`) to its size;
    `subject` names the inputs and `what` their axes in the message (`"mapped axes"`,
    `"leading axis (the number of steps)"`). Returns `None` when `sizes` is empty.
    """
    found = set(sizes.values())
    if not found:
        return None
    if len(found) > 1:
        listed = ", ".join(f"{where}: {size}" for where, size in sizes.items())
        raise ValueError(
            f"{owner}: {subject} must all have the same size along their {what}, but the "
            f"sizes are {listed}."
        )
    return found.pop()


def check_key(key: Any, *, owner: str, optional: bool = False) -> Any:
    """Refuse anything but one JAX random key: a typed key (`jax.random.key`) or the
    `uint32[2]` of `jax.random.PRNGKey`, returned as a typed key (`None` as it is, where
    `optional`)."""
    if key is None and optional:
        return None
    if isinstance(key, jax.Array):
        if jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key) and key.shape == ():
            return key
        if key.dtype == np.uint32 and key.shape == (2,):
            return jax.random.wrap_key_data(key)
    if optional:
        allowed = "None or a single JAX random key such as `jax.random.key(0)`"
    else:
        allowed = "a JAX random key, such as jax.random.key(0) (or a jax.random.PRNGKey)"
    raise TypeError(f"{owner}: `key` must be {allowed}, got {described(key)}.")


def refuses_forward_mode(error: Exception) -> bool:
    """Whether `error` is JAX's refusal to take a JVP of a `jax.custom_vjp` function."""
    return isinstance(error, TypeError) and "(jvp) to a custom_vjp function" in str(error)


@contextlib.contextmanager
def taking_jvps_of_fn(owner: str, mode: str = "mode='fwd'") -> Iterator[None]:
    """Around the code that takes JVPs of the user's `fn` in `mode`: JAX's bare refusal
    of a `jax.custom_vjp` function inside `fn` becomes a message that names the mode,
    the reason and the way out."""
    try:
        yield
    except TypeError as error:
        if not refuses_forward_mode(error):
            raise
        raise TypeError(
            f"{owner}: {mode} takes forward-mode derivatives (JVPs) of `fn`, but `fn` calls "
            "a function with a `jax.custom_vjp` rule, which JAX differentiates in reverse "
            "mode only. Pass mode='rev', which takes only reverse-mode derivatives (VJPs) "
            "of `fn`."
        ) from error
