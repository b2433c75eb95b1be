# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Independent per-silo VI, centralized VI, and the SFVI-Avg -> SFVI warm start."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax

import numpyro_fed as nf
from tests import _models as m


def _normal_mean(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def test_independent_fits_are_each_silos_own_posterior():
    """Each silo's fit is the exact posterior given its data alone."""
    y = jnp.asarray(np.random.default_rng(1).normal(size=12) + np.repeat([0.0, 3.0], 6))
    data = nf.FederatedData.from_groups(np.repeat([0, 1], 6), y=y)
    fed = nf.federate(_normal_mean, silos="data")
    fits = nf.baselines.fit_independent(
        fed, nf.AutoMeanField, optax.adam(0.02), data, jax.random.key(0), 3000
    )
    for j, fit in enumerate(fits):
        precision = 1 / 4 + 6
        mean = float(data.silo(j)["y"].sum()) / precision
        np.testing.assert_allclose(fit.params.eta_global["loc"][0], mean, atol=2e-3)
        np.testing.assert_allclose(
            fit.params.eta_global["scale"][0], precision**-0.5, rtol=1e-2
        )


def test_centralized_fit_uses_the_pooled_data():
    data = nf.FederatedData.from_groups(np.arange(40) % 3, **m.logistic_data())
    fed = nf.federate(m.logistic, silos="data")
    result = nf.baselines.fit_centralized(
        fed,
        nf.AutoGlobalLocalNormal(fed),
        optax.adam(0.05),
        data,
        jax.random.key(0),
        300,
    )
    assert result.params["_fed_global_loc"].shape == (3,)
    assert result.losses[-20:].mean() < result.losses[:20].mean()


def test_sfvi_warm_starts_from_sfvi_avg():
    """Figure S2's recipe: SFVI starts exactly where SFVI-Avg stopped."""
    data = nf.FederatedData.from_groups(np.arange(7) % 3, **m.hierarchical_data())
    fed = nf.federate(m.hierarchical, silos="group")
    guide = nf.AutoGlobalLocalNormal(fed)
    avg = nf.SFVIAvg(fed, guide, optax.adam(0.05), local_steps=5)
    warm = avg.run(jax.random.key(0), 3, data, progress_bar=False).params
    svi = nf.SFVI(fed, guide, optax.adam(0.05))
    state = svi.init(jax.random.key(1), data, init_params=warm)
    m.tree_allclose(svi.get_params(state), warm, rtol=1e-12, atol=1e-14)
