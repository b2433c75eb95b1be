# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""PVI's defaults on published reference posteriors (issue 22, item 4): slow."""

import jax
import numpy as np
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed import reference


@pytest.mark.slow
def test_default_synchronous_pvi_reaches_central_mean_field_vi_on_german_credit():
    """Flat logistic regression, 5 silos of 200 rows, correlated features: PVI at its
    defaults (synchronous, natural solver) is within 0.1 reference sd of centralized
    NumPyro SVI with the same mean-field family after 30 rounds (measured: 25), sds
    within 5 %. Before the Newton mean step it was 41 sds off after 200 rounds."""
    jax.config.update("jax_enable_x64", True)
    post = reference.load("german_credit_numeric_logistic_regression")
    fit = nf.PVI(post.fed_model)
    params = fit.run(jax.random.key(0), 30, post.data, progress_bar=False).params

    guide = AutoNormal(post.model)
    optim = optax.adam(optax.exponential_decay(1e-2, 5000, 0.5))
    svi = SVI(post.model, guide, optim, Trace_ELBO(num_particles=16))
    pooled = post.data.pooled()
    state = svi.init(jax.random.key(1), **pooled)
    step = jax.jit(lambda s: svi.update(s, **pooled)[0])
    locs, scales = [], []
    for i in range(20000):
        state = step(state)
        if i >= 15000 and i % 10 == 0:
            p = svi.get_params(state)
            locs.append(p["weights_auto_loc"])
            scales.append(p["weights_auto_scale"])
    ref_sd = post.reference["weights"].sd
    error = np.abs(params.eta_global["loc"] - np.mean(locs, 0)) / ref_sd
    assert np.max(error) < 0.1
    ratio = params.eta_global["scale"] / np.mean(scales, 0)
    np.testing.assert_allclose(ratio, 1.0, atol=0.05)


@pytest.mark.slow
def test_default_pvi_on_radon_keeps_valid_cavities_and_improves():
    """Radon, 85 county silos, Uniform(0, 100) scales: at its defaults PVI raised
    InvalidCavity (silo 14) as a Newton step through a wide q overshot on the
    log-scales; the natural solver's line search keeps every cavity valid, and the
    free energy falls."""
    jax.config.update("jax_enable_x64", True)
    post = reference.load("radon_contextual_effects_minnesota")
    result = nf.PVI(post.fed_model).run(
        jax.random.key(0), 20, post.data, progress_bar=False
    )
    losses = np.asarray(result.losses)
    assert np.all(np.isfinite(losses))
    assert np.all(np.asarray(result.history["invalid_cavity"]) < 0)
    assert np.mean(losses[-3:]) < losses[0] - 100
