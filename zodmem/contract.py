"""What a new transform fills in, and the engine it runs its blocks with.

A zodmem blocked transform is an `eqx.Module` that derives from `AbstractBlocked` and
fills its abstract methods; the base owns the call and gives it the rest. A subclass that
says what its work is (`work`), how a plan fixes its block size (`with_block_size`) and
how to compute its result, or one device's share of it, in blocks (`compute_share`, with
`map_blocks`, `scan_blocks` or `reduce_blocks`) is planned from `max_memory` (`plan()`),
runs under `jax.jit`, shows a progress bar from inside its compiled loop, streams to the
host or a file with `zm.to_host`/`zm.to_file`, and spreads its result over devices with
`sharding` (or, restating `split` and `specs`, its batch where it lies). Every built-in
blocked transform (`BatchedJacobian`, `BatchedHessian`, `BatchedGGN`, `ChunkedVmap`,
`Microbatcher`) is written this way.

`AbstractStreamable` and `AbstractSharded`, the names of the streamed and sharded bases
of earlier releases, are kept as other names of `AbstractBlocked`, which now does both.

!!! example

    ```python
    import dataclasses
    from typing import Any, Callable

    import equinox as eqx
    import jax
    import jax.numpy as jnp
    import numpy as np
    import zodmem as zm
    from zodmem import contract


    class RowNorms(contract.AbstractBlocked):
        # The norm of every row of `fn(x)`, a block of rows at a time.
        fn: Callable[..., Any]
        batch_size: int | None = eqx.field(default=None, static=True, kw_only=True)
        max_memory: int | str | None = eqx.field(default=None, static=True, kw_only=True)
        sharding: Any = eqx.field(default=None, static=True, kw_only=True)
        jit: bool = eqx.field(default=True, static=True, kw_only=True)
        progress: bool = eqx.field(default=False, static=True, kw_only=True)

        def work(self, x):
            rows = jax.eval_shape(self.fn, x).shape[0]
            size = rows if self.batch_size is None else min(self.batch_size, rows)
            return contract.Work(rows, "rows", "row norms", size).per_device(self.split(x))

        def with_block_size(self, size, strategy):
            return dataclasses.replace(self, batch_size=size, max_memory=None)

        def compute_share(self, sink, share, split, x):
            a = self.fn(x)
            plan = contract.plan_blocks(a.shape[0], batch_size=self.batch_size)
            plan, offset = contract.share_of(
                a.shape[0], plan, share, split, owner="RowNorms", what="rows"
            )

            def block(start):
                rows = jax.lax.dynamic_slice_in_dim(a, start + offset, plan.block_size)
                return jnp.linalg.norm(rows, axis=1)

            part = None if sink is None else sink.part([0], plan)
            return contract.map_blocks(
                block, plan, axis=0, sink=part, progress=contract.progress_label(self)
            )


    x = jnp.arange(12.0).reshape(4, 3)
    norms = RowNorms(jnp.tanh, max_memory="10MB")
    assert norms.plan(x).fits
    np.testing.assert_allclose(norms(x), jnp.linalg.norm(jnp.tanh(x), axis=1), rtol=1e-6)
    np.testing.assert_allclose(zm.to_host(norms, x), norms(x))
    ```
"""

from ._engine._block_plans import BlockPlan as BlockPlan, plan_blocks as plan_blocks
from ._engine._blocks import (
    map_blocks as map_blocks,
    reduce_blocks as reduce_blocks,
    scan_blocks as scan_blocks,
)
from ._engine._progress import label as progress_label
from ._engine._sharding import share_of as share_of
from ._plan._plans import Work as Work
from ._transforms._base import (
    AbstractBlocked as AbstractBlocked,
    AbstractSharded as AbstractSharded,
    AbstractStreamable as AbstractStreamable,
    AbstractTransform as AbstractTransform,
)

__all__ = [
    "AbstractTransform",
    "AbstractBlocked",
    "AbstractStreamable",
    "AbstractSharded",
    "Work",
    "BlockPlan",
    "plan_blocks",
    "map_blocks",
    "scan_blocks",
    "reduce_blocks",
    "share_of",
    "progress_label",
]
