# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The shared helpers: ``rmatvec`` (summed by columns for small matrices, a dot for
large ones, the same product either way), ``unit_normals`` (rows of one pooled
normal draw) and ``constrain`` / ``flat_barrier`` (the same values, computed as
one axis)."""

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import constraints
from numpyro.distributions.transforms import biject_to
import pytest

from numpyro_fed.util import (
    RMATVEC_COLUMN_SUM_MAX,
    _counter_words,
    all_finite,
    constrain,
    flat_barrier,
    rmatvec,
    unit_normals,
)

SIZES = [5, RMATVEC_COLUMN_SUM_MAX, RMATVEC_COLUMN_SUM_MAX + 1]


def integer_matrix(size, batch, symmetric):
    # Small integers: every product and sum is exact in float64, whatever the order.
    rng = np.random.default_rng(size)
    matrix = rng.integers(-9, 10, size=batch + (size, size)).astype(float)
    vector = rng.integers(-9, 10, size=size).astype(float)
    if symmetric:
        matrix = matrix + np.swapaxes(matrix, -1, -2)
    return matrix, vector


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("batch", [(), (3,)])
def test_rmatvec_is_the_transposed_product(size, batch):
    matrix, vector = integer_matrix(size, batch, symmetric=False)
    expected = np.einsum("...ji,j->...i", matrix, vector)
    assert not np.array_equal(expected, np.einsum("...ij,j->...i", matrix, vector))
    got = jax.jit(rmatvec)(jnp.asarray(matrix), jnp.asarray(vector))
    np.testing.assert_array_equal(got, expected)


@pytest.mark.parametrize("size", SIZES)
def test_rmatvec_of_a_symmetric_matrix(size):
    matrix, vector = integer_matrix(size, (3,), symmetric=True)
    got = jax.jit(rmatvec, static_argnums=2)(
        jnp.asarray(matrix), jnp.asarray(vector), True
    )
    np.testing.assert_array_equal(got, np.einsum("...ij,j->...i", matrix, vector))


def test_rmatvec_of_a_large_symmetric_matrix_is_the_plain_dot():
    # Bit for bit the product grad_log_density took before rmatvec: large factors'
    # chains are unchanged.
    rng = np.random.default_rng(0)
    a = rng.normal(size=(RMATVEC_COLUMN_SUM_MAX + 8,) * 2)
    matrix, vector = jnp.asarray(a + a.T), jnp.asarray(rng.normal(size=len(a)))
    plain = jax.jit(lambda m, v: jnp.einsum("...ij,j->...i", m, v))(matrix, vector)
    got = jax.jit(rmatvec, static_argnums=2)(matrix, vector, True)
    np.testing.assert_array_equal(got, plain)


def test_rmatvec_rectangular():
    matrix = jnp.arange(6.0).reshape(3, 2)  # (n, m) = (3, 2): returns (2,)
    np.testing.assert_array_equal(
        rmatvec(matrix, jnp.array([1.0, 10.0, 100.0])), [420.0, 531.0]
    )


@pytest.mark.parametrize("x64", [False, True])
@pytest.mark.parametrize("dim", [1, 3, 8])
def test_unit_normals_are_rows_of_the_pooled_draw(x64, dim):
    # Any silo's units draw exactly the rows a pooled draw gives them, in float32
    # and float64, from a typed or a raw key.
    with jax.enable_x64(x64):
        ids = jnp.array([41, 0, 7, 7, 3, 99])
        for key in (jax.random.key(5), jax.random.PRNGKey(5)):
            rows = unit_normals(key, ids, dim)
            pooled = jax.random.normal(key, (100, dim))
            assert rows.dtype == pooled.dtype
            np.testing.assert_array_equal(rows, pooled[ids])
        nested = unit_normals(key, ids.reshape(2, 3), dim)
        np.testing.assert_array_equal(nested, pooled[ids].reshape(2, 3, dim))


@pytest.mark.parametrize("dim", [1, 7, 4097, 65535])
def test_counter_words_are_the_64_bit_counter(dim):
    # Ids whose counters leave 32 bits: the (high, low) words are u * dim + k.
    rng = np.random.default_rng(0)
    ids = np.concatenate([[0, 65535, 65536, 2**31 - 1], rng.integers(0, 2**31, 500)])
    hi, lo = _counter_words(jnp.asarray(ids, jnp.int32)[:, None], dim)
    counters = ids.astype(np.uint64)[:, None] * np.uint64(dim) + np.arange(
        dim, dtype=np.uint64
    )
    np.testing.assert_array_equal(np.asarray(hi), counters >> np.uint64(32))
    np.testing.assert_array_equal(np.asarray(lo), counters & np.uint64(2**32 - 1))


def test_unit_normals_take_a_non_threefry_key():
    # An "rbg" key has four words: each unit draws from its own folded key (the
    # draws before the counters), in the rows' layout.
    key = jax.random.key(3, impl="rbg")
    ids = jnp.array([[4, 0], [9, 2]])
    rows = unit_normals(key, ids, 3)
    assert rows.shape == (2, 2, 3) and bool(jnp.all(jnp.isfinite(rows)))
    folded = jax.vmap(lambda u: jax.random.normal(jax.random.fold_in(key, u), (3,)))
    np.testing.assert_array_equal(rows, folded(ids.ravel()).reshape(2, 2, 3))


def test_constrain_is_the_bijection():
    # softplus_positive and real act entry by entry (computed as one axis);
    # simplex maps each row (kept in its shape): every value equals the bijection's.
    rng = np.random.default_rng(0)
    values = {
        "scale": jnp.asarray(rng.normal(size=(7, 1))),
        "loc": jnp.asarray(rng.normal(size=(7, 3))),
        "weights": jnp.asarray(rng.normal(size=(7, 3))),
    }
    spec = {
        "scale": constraints.softplus_positive,
        "loc": constraints.real,
        "weights": constraints.simplex,
    }
    flat = constrain(spec, values)
    for name, value in values.items():
        expected = biject_to(spec[name])(value)
        assert flat[name].shape == expected.shape, name
        np.testing.assert_array_equal(flat[name], expected, err_msg=name)
    np.testing.assert_array_equal(jax.jit(flat_barrier)(values["loc"]), values["loc"])


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg"])
def test_unit_normals_of_one_key_a_silo_are_the_vmap(impl):
    keys = jax.random.split(jax.random.key(3, impl=impl), 4)
    ids = jnp.arange(12).reshape(4, 3)[:, ::-1]
    batched = unit_normals(keys, ids, 2)
    looped = jax.vmap(unit_normals, in_axes=(0, 0, None))(keys, ids, 2)
    assert batched.shape == (4, 3, 2)
    np.testing.assert_array_equal(batched, looped)
    if impl == "threefry2x32":  # JAX promises rbg keys no vmap-invariant bits
        np.testing.assert_array_equal(batched[1], unit_normals(keys[1], ids[1], 2))


def test_all_finite_is_exact():
    big = jnp.full((3, 4), jnp.finfo(jnp.float32).max, jnp.float32)  # sums overflow
    assert bool(all_finite({"a": big, "ids": jnp.arange(3)}))
    for bad in (jnp.inf, -jnp.inf, jnp.nan):
        tree = {"a": big, "b": jnp.zeros(5).at[2].set(bad)}
        assert not bool(all_finite(tree)), bad
        assert not bool(jax.jit(all_finite)(tree)), bad
    assert bool(all_finite({}))
