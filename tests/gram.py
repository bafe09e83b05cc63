"""A blocked transform written against zodmem's declared contract (`zodmem.contract`),
for the tests: it fills in `AbstractBlocked`'s abstract methods and nothing else, reads
nothing private, and gets budgets, sharding, progress bars and streaming from the base."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
from jax.sharding import NamedSharding

from zodmem.contract import (
    AbstractBlocked,
    Work,
    map_blocks,
    plan_blocks,
    progress_label,
    share_of,
)


class BlockedGram(AbstractBlocked):
    """`A @ A.T` for `A = fn(x)` of shape `(m, k)`, a block of rows at a time."""

    fn: Callable[..., Any]
    batch_size: int | None = eqx.field(default=None, static=True, kw_only=True)
    max_memory: int | str | None = eqx.field(default=None, static=True, kw_only=True)
    sharding: NamedSharding | None = eqx.field(default=None, static=True, kw_only=True)
    jit: bool = eqx.field(default=True, static=True, kw_only=True)
    progress: bool = eqx.field(default=False, static=True, kw_only=True)

    def work(self, x: Any) -> Work:
        rows = jax.eval_shape(self.fn, x).shape[0]
        size = rows if self.batch_size is None else min(self.batch_size, rows)
        return Work(rows, "rows", "Gram matrix", size).per_device(self.split(x))

    def with_block_size(self, size: int, strategy: Any) -> BlockedGram:
        return dataclasses.replace(self, batch_size=size, max_memory=None)

    def compute_share(self, sink: Any, share: Any, split: Any, x: Any) -> Any:
        a = self.fn(x)
        plan = plan_blocks(a.shape[0], batch_size=self.batch_size)
        plan, offset = share_of(a.shape[0], plan, share, split, owner="BlockedGram", what="rows")

        def rows(start):
            return jax.lax.dynamic_slice_in_dim(a, start + offset, plan.block_size) @ a.T

        part = None if sink is None else sink.part([0], plan)
        return map_blocks(rows, plan, axis=0, sink=part, progress=progress_label(self))
