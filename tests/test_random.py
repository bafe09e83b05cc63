"""The estimators' random sign probes: values, dtypes, and their statistics."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from zodmem._estimators._random import key_seed, sign_probes

pytestmark = pytest.mark.usefixtures("float64")


def probes(key, count, n, dtype=jnp.float64):
    return np.asarray(sign_probes(key, jnp.arange(count), n, dtype))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64, jnp.bfloat16])
def test_signs_in_the_dtype_asked(dtype):
    probe = sign_probes(jax.random.key(0), 3, 1000, dtype)
    assert probe.dtype == dtype and probe.shape == (1000,)
    assert set(np.unique(np.asarray(probe, np.float64))) == {-1.0, 1.0}


def test_probes_are_balanced_and_uncorrelated():
    """200 probes of 2,000 signs. Each test below compares a statistic that is about
    standard normal for independent fair signs with 5.5, or the largest of M such
    statistics with a bound of false-alarm rate below 1e-3 by Bonferroni (the seed is
    fixed, so a failure is a property of the generator, not bad luck)."""
    count, n = 200, 2000
    g = probes(jax.random.key(11), count, n)
    # Every sign fair: the mean of all 400,000 entries, and of each probe.
    assert abs(g.mean()) * np.sqrt(g.size) < 5.5
    assert np.max(np.abs(g.mean(axis=1))) * np.sqrt(n) < 5.5
    # Distinct probes uncorrelated: 19,900 pairs, each |z| < 5.5 (false alarm < 8e-4).
    z = (g @ g.T / n)[np.triu_indices(count, 1)] * np.sqrt(n)
    assert np.max(np.abs(z)) < 5.5
    # E[g g^T] = I: entries uncorrelated across probes, the neighbours included, which
    # a hash of consecutive positions is most likely to get wrong.
    neighbours = np.mean(g[:, :-1] * g[:, 1:], axis=0) * np.sqrt(count)
    assert np.max(np.abs(neighbours)) < 5.5
    covariance = (g[:, :300].T @ g[:, :300] / count)[np.triu_indices(300, 1)] * np.sqrt(count)
    assert np.max(np.abs(covariance)) < 5.5  # 44,850 pairs: false alarm < 2e-3


def test_keys_and_indices_give_different_probes():
    seen = set()
    for seed in range(20):
        for index in range(20):
            seen.add(
                np.asarray(sign_probes(jax.random.key(seed), index, 64, jnp.float32)).tobytes()
            )
    assert len(seen) == 400


def test_raw_and_typed_keys_and_traced_indices():
    typed = jax.random.key(5)
    raw = jax.random.PRNGKey(5)
    assert int(key_seed(typed)) == int(key_seed(raw))
    eager = sign_probes(typed, 7, 50, jnp.float32)
    traced = jax.jit(lambda k, i: sign_probes(k, i, 50, jnp.float32))(typed, 7)
    np.testing.assert_array_equal(eager, traced)
    mapped = jax.vmap(lambda i: sign_probes(typed, i, 50, jnp.float32))(jnp.arange(10))
    np.testing.assert_array_equal(mapped[7], eager)
    # A block of probes is the probes one at a time.
    np.testing.assert_array_equal(sign_probes(typed, jnp.arange(10), 50, jnp.float32), mapped)


def test_every_word_of_a_key_counts():
    base = np.asarray(jax.random.key_data(jax.random.key(0)))
    for word in range(base.size):
        changed = base.copy().ravel()
        changed[word] ^= 1
        other = jax.random.wrap_key_data(changed.reshape(base.shape))
        assert int(key_seed(other)) != int(key_seed(jax.random.wrap_key_data(base)))
