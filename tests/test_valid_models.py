# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Ordinary NumPyro models that federated inference must run unedited (issue 19)."""

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import numpyro_fed as nf
from tests import _models as m

# Rubin's eight schools: the known standard errors are data in a scale parameter.
SCHOOLS_Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SCHOOLS_SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def eight_schools(sigma, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("school", sigma.shape[0]):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def _schools():
    fed = nf.federate(eight_schools, silos="school")
    data = nf.FederatedData.from_groups(np.arange(8), sigma=SCHOOLS_SIGMA, y=SCHOOLS_Y)
    return fed, data


@pytest.mark.parametrize(
    "make",
    [
        lambda fed: nf.SFVI(fed, nf.AutoStructured(fed), optax.adam(0.05)),
        lambda fed: nf.SFVIAvg(
            fed, nf.AutoStructured(fed), optax.adam(0.05), local_steps=3
        ),
        lambda fed: nf.PVI(fed, nf.AutoMeanField(fed), optax.adam(0.05), local_steps=3),
    ],
    ids=["sfvi", "sfvi_avg", "pvi"],
)
def test_data_in_a_scale_parameter_sets_up_and_runs(make):
    """The known per-school sd is data in Normal's scale: set-up must not invent
    values for it (an all-zero copy fails NumPyro's argument check)."""
    fed, data = _schools()
    algorithm = make(fed)
    result = algorithm.run(jax.random.key(0), 5, data, progress_bar=False)
    assert np.isfinite(np.asarray(result.losses)).all()
    for leaf in jax.tree.leaves(result.params):
        assert np.isfinite(np.asarray(leaf)).all()


def test_data_in_a_scale_parameter_sfvi_equals_numpyro_svi():
    """SFVI, one school per silo, equals centralized NumPyro SVI with the same guide,
    iterate for iterate (float64, reproducible noise)."""
    fed, data = _schools()
    guide = nf.AutoStructured(fed)
    svi = nf.SFVI(fed, guide, optax.adam(0.05), stl=False)
    state, ref = m.numpyro_svi_reference(fed, guide, svi, data, 20, optax.adam(0.05))
    result = svi.run(None, 20, data, init_state=state, progress_bar=False)
    np.testing.assert_allclose(result.losses, ref.losses, rtol=1e-9)
    ours = svi.pooled_params(result.params, data)
    m.tree_allclose(ours, {k: ref.params[k] for k in ours}, rtol=1e-8, atol=1e-10)


# A conjugate model whose prior has a term outside any site: mu ~ N(0, 10^2) times the
# factor N(mu; 1, 0.5^2), then y_i ~ N(mu, 1).
FACTOR_Y = np.array([0.3, 1.2, -0.4, 2.0, 0.9, 1.5, 0.1, 1.1])


def factor_prior(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    numpyro.factor("prior_term", dist.Normal(1.0, 0.5).log_prob(mu))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def _factor_posterior():
    precision = 1 / 10.0**2 + 1 / 0.5**2 + len(FACTOR_Y)
    return (1.0 / 0.5**2 + FACTOR_Y.sum()) / precision, precision**-0.5


def test_global_factor_sfvi_equals_numpyro_svi():
    """A numpyro.factor outside the silo plate is a prior term of the server's: SFVI
    equals centralized NumPyro SVI on the same model, iterate for iterate."""
    fed = nf.federate(factor_prior, silos="data")
    data = nf.FederatedData.from_groups(m.split_groups(8, 3), y=FACTOR_Y)
    guide = nf.AutoStructured(fed)
    svi = nf.SFVI(fed, guide, optax.adam(0.05), stl=False)
    state, ref = m.numpyro_svi_reference(fed, guide, svi, data, 20, optax.adam(0.05))
    result = svi.run(None, 20, data, init_state=state, progress_bar=False)
    np.testing.assert_allclose(result.losses, ref.losses, rtol=1e-9)
    ours = svi.pooled_params(result.params, data)
    m.tree_allclose(ours, {k: ref.params[k] for k in ours}, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("algorithm", ["sfvi", "pvi"])
def test_global_factor_gives_the_exact_posterior(algorithm):
    """The factor counts once, in the closed-form Gaussian posterior."""
    fed = nf.federate(factor_prior, silos="data")
    data = nf.FederatedData.from_groups(m.split_groups(8, 3), y=FACTOR_Y)
    mean, sd = _factor_posterior()
    if algorithm == "sfvi":
        schedule = optax.exponential_decay(0.05, 500, 0.5)
        svi = nf.SFVI(
            fed, nf.AutoStructured(fed), optax.adam(schedule), num_particles=4
        )
        params = svi.run(jax.random.key(0), 3000, data, progress_bar=False).params
        tol = 5e-3
    else:
        # The factor hides the prior's form, so PVI refines it stochastically: the
        # tolerance covers that noise, and a dropped factor (sd 0.353) fails it.
        pvi = nf.PVI(
            fed,
            nf.AutoMeanField(fed),
            optax.adam(0.02),
            local_steps=300,
            num_particles=8,
        )
        params = pvi.run(jax.random.key(0), 60, data, progress_bar=False).params
        tol = 2e-2
    np.testing.assert_allclose(params.eta_global["loc"][0], mean, atol=tol)
    np.testing.assert_allclose(params.eta_global["scale"][0], sd, atol=tol)
