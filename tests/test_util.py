# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_fed.util import _counter_words, unit_normals


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
