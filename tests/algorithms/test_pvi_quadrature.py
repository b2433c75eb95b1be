# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""PVI's local quadrature: with local latents, the natural solver's expectations over
them at their noise's sigma points make each silo's solve deterministic and reach
mean-field VI's optimum (exactly, for a Gaussian hierarchy)."""

import jax
import numpy as np
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed import reference
from numpyro_fed.expfam import standard_sigma_points, to_moments
from tests import _models as m

Y = np.random.default_rng(0).normal(size=(12, 3)) + 1.5
FED = nf.federate(m.normal_normal, silos="group")
DATA = nf.FederatedData.from_groups(np.arange(12) % 3, y=Y)


def _fit(seed, rounds=80, **options):
    pvi = nf.PVI(FED, nf.AutoMeanField(FED), optax.adam(0.05), average=0, **options)
    result = pvi.run(jax.random.key(seed), rounds, DATA, progress_bar=False)
    return pvi, result.state.server.q


def test_standard_sigma_points_match_the_moments_of_a_standard_normal():
    points = np.asarray(standard_sigma_points(3))
    assert points.shape == (6, 3)
    np.testing.assert_allclose(points.mean(0), 0.0, atol=1e-15)
    np.testing.assert_allclose(points.T @ points / 6, np.eye(3), atol=1e-15)


def test_local_quadrature_is_the_default_with_local_latents():
    pvi, _ = _fit(0, rounds=1)
    assert pvi.quadrature()
    assert not nf.PVI(FED, local_quadrature=False, local_steps=1).quadrature()


def test_local_quadrature_reaches_the_mean_field_optimum():
    """A Gaussian hierarchy's mean-field optimum has the posterior's means and the
    diagonal of its precision: synchronous PVI with sigma-point local expectations
    reaches mu's, which Monte Carlo local solves (one draw) miss by their noise."""
    mean, cov = m.normal_normal_posterior(Y)
    prec = np.linalg.inv(cov)
    _, q = _fit(0)
    loc, var = (float(np.asarray(v)[0]) for v in to_moments(q))
    assert abs(loc - mean[0]) < 1e-4 * np.sqrt(cov[0, 0])
    assert abs(var * prec[0, 0] - 1) < 1e-4
    _, q_mc = _fit(0, local_quadrature=False)
    loc_mc = float(np.asarray(to_moments(q_mc)[0])[0])
    assert abs(loc_mc - mean[0]) > 1e-3 * np.sqrt(cov[0, 0])


@pytest.mark.parametrize("quadrature", [True, False])
def test_local_quadrature_makes_the_run_independent_of_the_noise(quadrature):
    """From the same start, silos whose noise key chains differ end at the same q
    with sigma-point local expectations (and not with Monte Carlo draws)."""
    pvi = nf.PVI(FED, nf.AutoMeanField(FED), optax.adam(0.05), average=0,
                 local_quadrature=quadrature)  # fmt: skip
    state = pvi.init(jax.random.key(0), DATA)
    other_noise = jax.vmap(lambda k: jax.random.fold_in(k, 7))(state.silos.rng_key)
    other = state._replace(silos=state.silos._replace(rng_key=other_noise))
    q0, q1 = (
        pvi.run(
            jax.random.key(0), 5, DATA, init_state=s, progress_bar=False
        ).state.server.q
        for s in (state, other)
    )
    same = np.allclose(np.asarray(q0.h), np.asarray(q1.h), rtol=1e-12, atol=0)
    assert same == quadrature


def test_local_quadrature_refuses_units_correlated_in_q():
    guide = nf.AutoGlobalLocalNormal(FED, local_cov="silo")
    with pytest.raises(ValueError, match="local_cov='silo'"):
        nf.PVI(FED, guide, local_quadrature=True)


def test_local_quadrature_default_is_off_for_many_global_coordinates():
    """Its cost grows with the global sigma points: item-response theory's 101 keep
    Monte Carlo draws by default."""
    post = reference.load("synthetic_item_response_theory")
    pvi = nf.PVI(post.fed_model, local_steps=1)
    pvi.init(jax.random.key(0), post.data)
    assert pvi.guide.global_dim > 50 and not pvi.quadrature()
