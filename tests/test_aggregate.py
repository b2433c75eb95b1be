# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""T7 (seed 000 spec §6.2): the Gaussian W2 barycenter and its parameterization."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_fed.aggregate import (
    cov_to_scale_tril,
    scale_tril_to_cov,
    w2_barycenter,
    w2_barycenter_diag,
    w2_barycenter_fn,
    w2_barycenter_ott,
    weighted_mean,
)


def _random_covs(key, num, dim):
    a = jax.random.normal(key, (num, dim, dim))
    return a @ jnp.swapaxes(a, -1, -2) + 0.5 * jnp.eye(dim)


def _sqrtm(m):
    values, vectors = np.linalg.eigh(np.asarray(m))
    return (vectors * np.sqrt(values)) @ vectors.T


def test_identical_inputs_return_the_input():
    cov = _random_covs(jax.random.key(0), 1, 3)[0]
    loc = jnp.array([1.0, -2.0, 0.5])
    (bary_loc, bary_cov), info = w2_barycenter(
        jnp.stack([loc] * 4), jnp.stack([cov] * 4)
    )
    np.testing.assert_allclose(bary_loc, loc, rtol=1e-12)
    np.testing.assert_allclose(bary_cov, cov, rtol=1e-10, atol=1e-12)
    assert int(info.num_iterations) <= 2


def test_diagonal_case_averages_standard_deviations():
    scales = jnp.array([[1.0, 2.0], [3.0, 0.5], [2.0, 2.0]])
    locs = jnp.arange(6.0).reshape(3, 2)
    (loc, scale), _ = w2_barycenter_diag(locs, scales)
    np.testing.assert_allclose(scale, scales.mean(0), rtol=1e-14)
    np.testing.assert_allclose(loc, locs.mean(0), rtol=1e-14)
    # the full-covariance iteration agrees with the closed form
    (_, cov), _ = w2_barycenter(locs, jax.vmap(jnp.diag)(scales**2))
    np.testing.assert_allclose(jnp.sqrt(jnp.diag(cov)), scales.mean(0), rtol=1e-10)


def test_commuting_covariances_closed_form():
    """Co-diagonalisable covariances: Sigma* = (mean_j Sigma_j^{1/2})^2."""
    q, _ = jnp.linalg.qr(jax.random.normal(jax.random.key(1), (3, 3)))
    spectra = jnp.array([[1.0, 4.0, 9.0], [4.0, 1.0, 0.25], [2.0, 3.0, 5.0]])
    covs = jnp.stack([q @ jnp.diag(s) @ q.T for s in spectra])
    (_, cov), info = w2_barycenter(jnp.zeros((3, 3)), covs)
    root = jnp.mean(jnp.stack([q @ jnp.diag(jnp.sqrt(s)) @ q.T for s in spectra]), 0)
    np.testing.assert_allclose(cov, root @ root, rtol=1e-9, atol=1e-12)
    assert float(info.residual) <= 1e-12


@pytest.mark.parametrize(
    "weights", [None, jnp.array([0.5, 0.2, 0.2, 0.1])], ids=["uniform", "weighted"]
)
def test_fixed_point_equation_holds(weights):
    covs = _random_covs(jax.random.key(2), 4, 4)
    (_, cov), info = w2_barycenter(jnp.zeros((4, 4)), covs, weights)
    w = np.full(4, 0.25) if weights is None else np.asarray(weights)
    root = _sqrtm(cov)
    rhs = sum(
        wj * _sqrtm(root @ np.asarray(c) @ root) for wj, c in zip(w, covs, strict=True)
    )
    np.testing.assert_allclose(cov, rhs, rtol=1e-9, atol=1e-10)
    assert int(info.num_iterations) < 200


def test_order_invariance():
    covs = _random_covs(jax.random.key(3), 5, 3)
    locs = jax.random.normal(jax.random.key(4), (5, 3))
    perm = jnp.array([3, 0, 4, 1, 2])
    (a_loc, a_cov), _ = w2_barycenter(locs, covs)
    (b_loc, b_cov), _ = w2_barycenter(locs[perm], covs[perm])
    np.testing.assert_allclose(a_loc, b_loc, rtol=1e-12)
    np.testing.assert_allclose(a_cov, b_cov, rtol=1e-9, atol=1e-12)


def test_agrees_with_ott_jax():
    """Our fixed point against ott-jax's Bures barycenter (the ``"ott"`` backend) on
    random SPD covariances and weights, float64.

    Tolerance: ott runs exactly N iterations from the identity. On covariances like
    these (condition numbers 3 to 15) the fixed point contracts the error by a factor
    3 to 10 per iteration (ours needs 10 to 23 iterations from the weighted mean to
    move by < 1e-12), so N = 50 leaves < 3**-50 ~ 1e-24 of the O(10) start: what
    remains is round-off and the Newton-Schulz square roots, stopped at a relative
    residual of 100 eps ~ 2e-14. Measured max |difference| / max |Sigma|: 4e-15 to
    3e-14 (d = 3 to 12, 3 seeds each), so 1e-11 of the largest entry leaves a margin
    of 300. After 3 iterations the difference is still > 1e-6, so the check can
    fail."""
    pytest.importorskip("ott")
    dim, num = 6, 5
    ka, kb, kc = jax.random.split(jax.random.key(10), 3)
    covs = _random_covs(ka, num, dim)
    locs = jax.random.normal(kb, (num, dim))
    weights = jax.random.dirichlet(kc, jnp.ones(num))
    assert covs.dtype == jnp.float64
    (loc, cov), info = w2_barycenter(locs, covs, weights)
    assert float(info.residual) <= 1e-12
    # jit: one compilation instead of op-by-op dispatch of ott's loops (3x faster).
    ott = jax.jit(w2_barycenter_ott, static_argnames="num_iterations")
    (ott_loc, ott_cov), ott_info = ott(locs, covs, weights, num_iterations=50)
    scale = float(jnp.max(jnp.abs(cov)))
    np.testing.assert_allclose(ott_loc, loc, rtol=1e-13, atol=1e-14)
    np.testing.assert_allclose(ott_cov, cov, rtol=0, atol=1e-11 * scale)
    assert int(ott_info.num_iterations) == 50
    assert float(ott_info.residual) <= 1e-11 * scale
    # The tolerance tells a converged barycenter from a stopped one: 3 iterations of
    # the same fixed point (ours, from the weighted mean) are still far off.
    (_, early), _ = w2_barycenter(locs, covs, weights, max_iterations=3)
    assert float(jnp.max(jnp.abs(early - cov))) > 1e-6 * scale


def test_barycenter_backend_names():
    assert w2_barycenter_fn("fixed_point") is w2_barycenter
    with pytest.raises(ValueError, match=r"barycenter must be one of .*'sinkhorn'"):
        w2_barycenter_fn("sinkhorn")


def test_missing_ott_names_the_extra(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "ott.geometry.costs", None)
    with pytest.raises(ImportError, match=r"numpyro-fed\[diagnostics\]"):
        w2_barycenter_fn("ott")


def test_cov_scale_tril_round_trip():
    cov = _random_covs(jax.random.key(7), 1, 4)[0]
    scale, tril = cov_to_scale_tril(cov)
    np.testing.assert_allclose(jnp.diag(tril), 1.0, rtol=1e-14)
    np.testing.assert_allclose(jnp.triu(tril, 1), 0.0)
    assert jnp.all(scale > 0)
    np.testing.assert_allclose(scale_tril_to_cov(scale, tril), cov, rtol=1e-12)


def test_jit_and_weighted_mean():
    covs = _random_covs(jax.random.key(8), 3, 2)
    locs = jnp.ones((3, 2))
    eager = w2_barycenter(locs, covs)
    jitted = jax.jit(w2_barycenter)(locs, covs)
    np.testing.assert_allclose(eager[0][1], jitted[0][1], rtol=1e-12)
    tree = {"a": jnp.array([1.0, 2.0, 6.0]), "b": jnp.ones((3, 2))}
    out = weighted_mean(tree, jnp.array([1.0, 1.0, 2.0]))
    np.testing.assert_allclose(out["a"], 3.75)
    np.testing.assert_allclose(out["b"], 1.0)


def test_float32_stops_at_round_off_not_at_the_iteration_cap():
    """A fixed absolute tolerance (1e-12) is below float32's round-off: every
    barycenter ran all 200 iterations (seconds a round for SFVI-Avg at 101 global
    coordinates). The default stops at round-off, with the float64 answer to float32
    accuracy; with max_iterations as the only stop it would report 200."""
    covs = _random_covs(jax.random.key(11), 6, 30)
    locs = jnp.zeros((6, 30))
    (_, exact), info64 = w2_barycenter(locs, covs)
    (_, cov), info = w2_barycenter(locs.astype(jnp.float32), covs.astype(jnp.float32))
    assert cov.dtype == jnp.float32
    assert int(info.num_iterations) < 50 and int(info64.num_iterations) < 50
    scale = float(jnp.max(jnp.abs(exact)))
    assert float(jnp.max(jnp.abs(cov - exact))) <= 1e-4 * scale
    assert float(info64.residual) <= 1e-12 * scale
