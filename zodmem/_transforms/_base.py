"""The transform base: `AbstractTransform`, every zodmem transform (a function `fn` and
its static configuration), and `AbstractBlocked`, the base of every built-in blocked
transform, the one that `zodmem.contract` makes public.

`AbstractBlocked` owns the call, as diffrax's integrate loop owns a solver's: it plans the
blocks from `max_memory`, spreads the work over devices, compiles it, and runs it or
streams it to a sink. A transform declares its work and one share of it:

- `work(*args, **kwargs)` and `with_block_size(size, strategy)`, what the planner needs
  (declared by `zodmem._plan._planned.AbstractPlanned`, which this base derives from:
  the blocks of products and probes of the operators and estimators, a layer below,
  are planned by that base alone);
- `compute_share(sink, share, split, *args, **kwargs)`, the result (or one device's share
  of it) in blocks, with the engine's loops;
- optionally `strategies`, `item_bytes`, and for work spread over devices `split` (which
  devices, and along which axis), `specs` (how the inputs and the result lie on them) and
  `result_specs` (the result's parts, where `sharding` places the result).

The derivatives spread their result as their `sharding` option says (`split`'s default);
`ChunkedVmap` and `Microbatcher` spread their batch where it lies (they restate `split`
and `specs`). The contract's older names, `AbstractStreamable` and `AbstractSharded`, are
this one base.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import equinox as eqx
import jax
from jax.sharding import PartitionSpec

from .._engine._block_plans import OutputSink
from .._engine._sharding import Share, Split, dispatch, replicate, split_of, to_mesh
from .._plan._planned import AbstractPlanned

__all__ = [
    "AbstractTransform",
    "AbstractBlocked",
    "AbstractStreamable",
    "AbstractSharded",
    "in_shares",
]

# The spec of an array whole on every device.
_WHOLE = PartitionSpec()


class AbstractTransform(eqx.Module):
    """A memory-bounded JAX transform of a function `fn`.

    `fn` is an ordinary field, so when it is a module (an Equinox model or another
    transform) its arrays are leaves of the transform. Every other field is static
    configuration, validated when the transform is built.

    !!! example

        ```python
        import jax.numpy as jnp
        import zodmem as zm

        hessian = zm.BatchedHessian(lambda w: jnp.sum(w**3), nbatches=2)
        assert isinstance(hessian, zm.AbstractTransform)
        assert hessian.config["nbatches"] == 2  # the static configuration, by name
        per_example = zm.ChunkedVmap(hessian, chunk_size=2)  # a transform wraps another
        assert per_example(jnp.ones((4, 3))).shape == (4, 3, 3)
        ```
    """

    fn: eqx.AbstractVar[Callable[..., Any]]

    @property
    def config(self) -> dict[str, Any]:
        """The static configuration, field name to value (everything but `fn`)."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if field.metadata.get("static", False)
        }


class AbstractBlocked(AbstractPlanned, AbstractTransform):
    """The base of a blocked transform: its work is cut into blocks sized by a count
    option or planned from a memory budget (`max_memory`, `plan()`), run compiled, spread
    over devices, with a progress bar from inside its compiled loop, and streamed to the
    host or a file (`zm.to_host`, `zm.to_file`).

    The base owns the call: it plans, reads how the work is spread over devices
    (`split`), runs `compute_share` once here or once per device inside one `shard_map`
    (under `jax.jit` unless the transform has `jit=False`), and hands each block to a
    sink when the call is streamed. A concrete transform declares the fields `fn`,
    `max_memory` and `progress` (and, to spread its result over devices, `sharding`;
    to run op by op, `jit`) and fills three methods:

    - `work(*args, **kwargs)`: what the call cuts into blocks (a `zodmem.contract.Work`);
    - `with_block_size(size, strategy)`: itself with `size` items per block and no
      budget, which is how a plan is applied;
    - `compute_share(sink, share, split, *args, **kwargs)`: the result, or one device's
      share of it, with the block loops of `zodmem.contract`.

    It may restate `strategies`, `item_bytes`, `split`, `specs` and `result_specs`, and
    the class variable `result_in_blocks` (`False` for a reduction, which `zm.to_host` and
    `zm.to_file` then refuse). Every built-in blocked transform (`BatchedJacobian`,
    `BatchedHessian`, `BatchedGGN`, `ChunkedVmap`, `Microbatcher`) fills these and
    nothing else of the call. The page "Writing your own transform" of the
    documentation builds one.

    `AbstractStreamable` and `AbstractSharded`, names of earlier releases, are this base.
    """

    # Whether the result is made block by block, so that `zm.to_host` and `zm.to_file`
    # can take it as it is made; a reduction (`Microbatcher`) is not, and they refuse it.
    result_in_blocks: ClassVar[bool] = True

    @abc.abstractmethod
    def compute_share(
        self, sink: Any, share: Share | None, split: Split | None, *args: Any, **kwargs: Any
    ) -> Any:
        """The result of the call with these arguments, in the blocks `work` describes.

        With `split` (how the work is spread over devices, from `split()`) and `share`
        (this device's place in it), only this device's share: for a result spread by
        `sharding`, `zodmem.contract.share_of` turns them into the block plan and the
        offset of its items; for inputs spread by `specs`, the arguments are already
        this device's part. With `sink` (not `None`, the call is streamed), each finished
        block is handed to `sink.part(...)` through the block loop's `sink` argument
        rather than written into a result on the device."""

    def split(self, *args: Any, **kwargs: Any) -> Split | None:
        """How the call with these arguments is spread over devices (`None`: here, not
        at all). By default, as the transform's `sharding` field (a `NamedSharding` of its
        result, where it has one) spreads the result. A transform that maps or reduces its
        batch where it lies returns the split of its batch arguments. The base reads it
        where the arguments are concrete, before compiling the call."""
        sharding = getattr(self, "sharding", None)  # a transform may have no such option
        if sharding is None:
            return None
        return split_of(sharding, owner=self._owner)

    def specs(self, split: Split, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        """`(in_specs, out_specs)`: how the call's inputs and its result lie on the
        devices of `split`. `in_specs` is `None` (every input whole on each device, the
        default) or a function of the array part of `(args, kwargs)` that returns their
        partition specs (a batch each device reads its own part of); `out_specs` are the
        result's specs, or a function of its shapes that returns them. By default the
        inputs are whole and the result is placed as `result_specs` says."""
        sharding = getattr(self, "sharding", None)
        if sharding is None:
            return None, _WHOLE
        return None, self.result_specs(sharding.spec)

    def result_specs(self, spec: PartitionSpec) -> Any:
        """The partition specs of the result's parts when `sharding` has the spec `spec`
        (the default: the result is one array placed by `spec`)."""
        return spec

    def run(self, *args: Any, **kwargs: Any) -> Any:
        """The call in the blocks the count or size option gives, nothing planned (what
        a plan runs, and what the planner compiles): `compute_share` here, or once per
        device of `split()` inside one `shard_map`, compiled unless `jit=False`."""
        # Read here, where the arrays are concrete: traced, an array shows its sharding
        # only over explicit mesh axes.
        split = self.split(*args, **kwargs)
        if split is not None:  # under jax.distributed: the inputs as global arrays
            args, kwargs = to_mesh((args, kwargs), split.mesh)
        compiled = getattr(self, "jit", True)  # a transform without the option compiles
        return (_in_shares_jit if compiled else in_shares)(self, args, kwargs, split)

    def streamed(self, sink: OutputSink, *args: Any, **kwargs: Any) -> Any:
        """The call in the blocks the count or size option gives, handing each block of
        the result to `sink` (an `OutputSink`): what `zm.to_host` and `zm.to_file` run.
        Returns the result with `None` at the leaves handed over."""
        return in_shares(self, args, kwargs, self.split(*args, **kwargs), sink)


AbstractStreamable = AbstractBlocked
AbstractSharded = AbstractBlocked


def in_shares(
    transform: AbstractBlocked, args: tuple, kwargs: dict, split: Split | None, sink: Any = None
) -> Any:
    """`compute_share` where the work lies: here, or once per device of `split`."""
    in_specs, out_specs = (None, None) if split is None else transform.specs(split, *args, **kwargs)
    if sink is not None and in_specs is not None:
        # Streamed to the host in order: inputs spread over devices are made whole first.
        args, kwargs = replicate((args, kwargs), split.mesh)
        split = None

    # The transform's own arrays (a vector a product is taken with, say) are inputs of
    # the devices' map, whole on each, never values its trace closes over: on explicit
    # mesh axes a closed-over sharded array could not enter the map.
    own, rest = eqx.partition(transform, eqx.is_array)

    def compute(share, split, inputs):
        own, args, kwargs = inputs
        return eqx.combine(own, rest).compute_share(sink, share, split, *args, **kwargs)

    def specs(arrays):
        own, args, kwargs = arrays
        whole = jax.tree_util.tree_map(lambda _: PartitionSpec(), own)
        return (whole, *in_specs((args, kwargs)))

    return dispatch(
        compute,
        (own, args, kwargs),
        split,
        here=sink is not None,
        in_specs=None if in_specs is None else specs,
        out_specs=_WHOLE if out_specs is None else out_specs,
    )


_in_shares_jit = eqx.filter_jit(in_shares)
