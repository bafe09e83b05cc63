"""A new blocked transform is the abstract methods of the protocol: `BlockedGram`
(tests/gram.py) gets budgets, plans, progress bars and streaming to the host and to a
file from the base classes, and equals the plain JAX answer."""

import ast
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gram import BlockedGram
from helpers import close

import zodmem as zm

pytestmark = pytest.mark.usefixtures("float64")


def features(x):
    return jnp.stack([jnp.sin(x), jnp.cos(2 * x), x**2], axis=1)


X = jnp.linspace(-1.0, 1.0, 12)
EXPECTED = features(X) @ features(X).T


@pytest.mark.parametrize("batch_size", [None, 1, 5, 12])
def test_blocks_of_rows_equal_the_matrix(batch_size):
    gram = BlockedGram(features, batch_size=batch_size)
    close(gram(X), EXPECTED)
    close(jax.jit(gram)(X), EXPECTED)
    assert gram(X).dtype == EXPECTED.dtype
    if batch_size is not None:
        assert gram.plan(X).num_blocks == -(-12 // batch_size)


def test_a_budget_plans_the_blocks():
    x = jnp.linspace(-1.0, 1.0, 60)
    peaks = [BlockedGram(features, batch_size=b).plan(x).peak_bytes for b in (1, 5, 30, 60)]
    budget = sorted(peaks)[1]  # some block sizes fit, others do not
    gram = BlockedGram(features, max_memory=budget)
    plan = gram.plan(x)
    assert plan.fits and plan.peak_bytes <= budget and plan.what == "rows"
    close(gram(x), features(x) @ features(x).T)
    with pytest.raises(zm.MemoryBudgetError, match="BlockedGram: .* the Gram matrix alone"):
        BlockedGram(features, max_memory=100).plan(X)


def test_progress_bar(capfd):
    BlockedGram(features, batch_size=4, progress=True)(X)
    err = capfd.readouterr().err
    assert "BlockedGram" in err and "3/3" in err


def test_streamed_to_host_and_to_file(tmp_path):
    gram = BlockedGram(features, batch_size=5)
    host = zm.to_host(gram, X)
    assert isinstance(host, np.ndarray)
    close(host, EXPECTED)
    close(zm.to_file(tmp_path / "gram.npy", gram, X), EXPECTED)
    close(zm.to_file(tmp_path / "gram.npy", gram, X), EXPECTED)  # finished: read back


def _outputs(params, data):
    return jnp.tanh(data @ params["w"] + params["b"])


DERIVATIVES = {
    "jacobian": zm.BatchedJacobian(_outputs, batch_size=2),
    "hessian": zm.BatchedHessian(lambda p, d: jnp.sum(_outputs(p, d) ** 2), batch_size=2),
    "ggn": zm.BatchedGGN(_outputs, lambda o, d: jnp.sum(o**2), batch_size=2),
}


@pytest.mark.parametrize("name", sorted(DERIVATIVES))
def test_derivatives_fill_one_hook_of_one_base(name):
    """The three derivatives derive from one base and fill its one preparation hook,
    `_prepare`; the work, the plans' block sizes and the result's specs are the base's."""
    from zodmem._transforms._derivative import AbstractDerivative, Prepared

    transform = DERIVATIVES[name]
    assert isinstance(transform, AbstractDerivative)
    for method in ("work", "with_block_size", "result_specs", "strategies"):
        assert method not in vars(type(transform)), method
    assert "_prepare" in vars(type(transform))

    params = {"b": jnp.zeros(()), "w": jnp.linspace(0.1, 0.4, 3)}
    data = jnp.linspace(-1.0, 1.0, 6).reshape(2, 3)
    prepared = transform._prepare(params, (data,), {}, None)
    assert isinstance(prepared, Prepared)
    assert prepared.n == 4 and prepared.mode in ("fwd", "rev")
    close(prepared.fn(prepared.leaves), transform.fn(params, data))
    rows = prepared.m if name == "jacobian" and prepared.mode == "rev" else prepared.n
    assert transform.work(params, data).total == rows


def test_the_contract_is_one_base_that_every_built_in_fills():
    """The contract's base owns the call: the built-in blocked transforms fill its hooks
    (`work`, `with_block_size`, `compute_share`, and where they spread a batch, `split`
    and `specs`) and take the call itself (plan, run, stream) from it, as `BlockedGram`
    does; the older names of the contract are that base."""
    base = zm.contract.AbstractBlocked
    assert zm.contract.AbstractSharded is base and zm.contract.AbstractStreamable is base
    built_in = [zm.BatchedJacobian, zm.BatchedHessian, zm.BatchedGGN, zm.ChunkedVmap]
    for cls in [*built_in, zm.Microbatcher, BlockedGram]:
        assert issubclass(cls, base) and issubclass(cls, zm.AbstractTransform)
        assert not cls.__abstractmethods__
        for name in ("plan", "planned", "run", "streamed"):
            assert getattr(cls, name) is getattr(base, name), (cls.__name__, name)
        assert cls.compute_share is not base.compute_share
    assert not zm.Microbatcher.result_in_blocks  # a reduction: not streamed


def test_a_user_transform_reads_nothing_private():
    tree = ast.parse(inspect.getsource(inspect.getmodule(BlockedGram)))
    private = [
        node.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute) and node.attr.startswith("_")
    ]
    assert not private, f"tests/gram.py reads private names: {private}"
