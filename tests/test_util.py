# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""``rmatvec``: ``matrix^T @ vector`` summed by columns for small matrices and by a
dot for large ones, the same product either way."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_fed.util import RMATVEC_COLUMN_SUM_MAX, rmatvec


@pytest.mark.parametrize(
    "size", [5, RMATVEC_COLUMN_SUM_MAX, RMATVEC_COLUMN_SUM_MAX + 1]
)
@pytest.mark.parametrize("batch", [(), (3,)])
def test_rmatvec_is_the_transposed_product(size, batch):
    # Small integers: every product and sum is exact in float64, whatever the order.
    rng = np.random.default_rng(size)
    matrix = rng.integers(-9, 10, size=batch + (size, size)).astype(float)
    vector = rng.integers(-9, 10, size=size).astype(float)
    expected = np.einsum("...ji,j->...i", matrix, vector)  # not symmetric: M^T != M
    assert not np.array_equal(expected, np.einsum("...ij,j->...i", matrix, vector))
    got = jax.jit(rmatvec)(jnp.asarray(matrix), jnp.asarray(vector))
    np.testing.assert_array_equal(got, expected)


def test_rmatvec_rectangular():
    matrix = jnp.arange(6.0).reshape(3, 2)  # (n, m) = (3, 2): returns (2,)
    np.testing.assert_array_equal(
        rmatvec(matrix, jnp.array([1.0, 10.0, 100.0])), [420.0, 531.0]
    )
