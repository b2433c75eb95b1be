# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""FSGLD's bounded conducive gradient (issue 22, item 2): unchanged inside the
surrogates' ellipsoid, constant along rays outside it, and still of mean zero over
the silo choice everywhere, so the estimator stays unbiased."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_fed as nf
from numpyro_fed.algorithms.sgld import conducive_factors
from numpyro_fed.algorithms.sgld_bounds import bounded_position, conducive_bound
from numpyro_fed.expfam import GaussianNat, grad_log_density
from numpyro_fed.util import take


def _surrogates(diagonal):
    rng = np.random.default_rng(0)
    means = rng.normal(size=(3, 2))
    if diagonal:
        prec = rng.uniform(0.5, 4.0, size=(3, 2))
        return GaussianNat(jnp.asarray(prec * means), jnp.asarray(prec))
    a = rng.normal(size=(3, 2, 2))
    prec = a @ np.swapaxes(a, 1, 2) + np.eye(2)
    return GaussianNat(jnp.asarray(np.einsum("sij,sj->si", prec, means)), prec)


@pytest.mark.parametrize("diagonal", [False, True], ids=["full", "diag"])
def test_bounded_conducive_term_keeps_zero_mean_and_stops_growing(diagonal):
    jax.config.update("jax_enable_x64", True)
    q = _surrogates(diagonal)
    f = jnp.array([0.2, 0.3, 0.5])
    factors = conducive_factors(q, f)
    bound = conducive_bound(q, 2.0)
    prec = np.asarray(q.prec).sum(0)
    prec = np.diag(prec) if diagonal else prec
    center = np.linalg.solve(prec, np.asarray(q.h).sum(0))
    np.testing.assert_allclose(bound.center, center, rtol=1e-12)

    def terms(theta):
        at = bounded_position(bound, jnp.asarray(theta))
        return np.stack([grad_log_density(take(factors, s), at) for s in range(3)])

    def distance(theta):
        d = np.asarray(theta) - center
        return float(np.sqrt(d @ prec @ d))

    inside = center + np.array([0.3, -0.2]) / np.sqrt(np.diag(prec))
    assert distance(inside) < 2.0
    np.testing.assert_array_equal(bounded_position(bound, jnp.asarray(inside)), inside)
    for scale in (1.0, 10.0, 1e6):
        far = center + scale * np.array([7.0, -3.0])
        at = np.asarray(bounded_position(bound, jnp.asarray(far)))
        np.testing.assert_allclose(distance(at), 2.0, rtol=1e-10)  # on the surface
        direction = (at - center) / np.linalg.norm(at - center)
        ray = (far - center) / np.linalg.norm(far - center)
        np.testing.assert_allclose(direction, ray, rtol=1e-10)  # along the ray
        g = terms(far)
        np.testing.assert_allclose(np.asarray(f) @ g, 0.0, atol=1e-10)  # mean zero
        np.testing.assert_allclose(g, terms(center + 3 * np.array([7.0, -3.0])))


def test_full_conducive_factors_are_exactly_symmetric():
    """grad_log_density reads A_s by columns (A_s^T theta), so conducive_factors
    makes A_s its own transpose: unchanged for symmetric surrogates, symmetrized for
    ones off by round-off."""
    jax.config.update("jax_enable_x64", True)
    q = _surrogates(diagonal=False)
    f = jnp.array([0.2, 0.3, 0.5])
    prec = np.asarray(q.prec)
    assert np.array_equal(prec, np.swapaxes(prec, 1, 2))
    plain = 0.7 * (jnp.sum(q.prec, 0) - q.prec / f[:, None, None])  # unsymmetrized
    np.testing.assert_array_equal(conducive_factors(q, f, 0.7).prec, plain)
    skew = prec.copy()
    skew[:, 0, 1] *= 1 + 1e-12
    a = np.asarray(conducive_factors(q._replace(prec=jnp.asarray(skew)), f).prec)
    np.testing.assert_array_equal(a, np.swapaxes(a, 1, 2))
    np.testing.assert_allclose(a, conducive_factors(q, f).prec, rtol=1e-11)


def test_conducive_radius_is_checked():
    def model(y):
        pass

    q = _surrogates(True)
    with pytest.raises(ValueError, match="conducive_radius must be positive"):
        nf.FSGLD(model, 1e-3, q, conducive_radius=0.0)
