# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""T6 (seed 003 spec): federated mean-field VI on the Gaussian augmented model reaches
its closed-form optimum: means within 2e-2, block variances within 5 %."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import numpyro_fed as nf


@pytest.mark.slow
def test_t6_meanfield_optimum_in_closed_form():
    from pathlib import Path
    import sys

    sys.path.insert(0, str(Path(__file__).parents[2] / "examples"))
    import vertical_fl as example

    rng = np.random.default_rng(0)
    n, rho, sigma, steps = 40, 0.4, 0.7, 4000
    xs = {k: rng.normal(size=(n, 2)) for k in "abc"}
    y = sum(xs[k] @ rng.normal(size=2) for k in "abc") + sigma * rng.normal(size=n)
    data = nf.VerticalData(
        {k: {f"x_{k}": jnp.asarray(xs[k])} for k in "abc"}, {"y": jnp.asarray(y)}
    )
    aug = nf.augment(example.linear_model, rho)
    vfl = nf.VerticalSFVI(
        aug,
        nf.VerticalFamily(aux="meanfield", theta_cov="full"),
        optax.adam(optax.exponential_decay(0.05, steps, 0.01)),
    )
    result = vfl.run(jax.random.key(0), steps, data, progress_bar=False)
    shapes = {f"beta_{k}": (2,) for k in "abc"} | {f"{k}/z": (n,) for k in "abc"}
    mean, prec = example.exact_gaussian(aug, data.pooled(), shapes)
    var_z = 1 / (1 / rho**2 + 1 / sigma**2)
    for i, k in enumerate("abc"):
        p = result.params.parties[k]
        block = slice(2 * i, 2 * i + 2)
        np.testing.assert_allclose(p["loc"], mean[block], atol=2e-2)
        cov_q = p["scale_tril"] @ p["scale_tril"].T
        cov_opt = jnp.linalg.inv(prec[block, block])
        np.testing.assert_allclose(
            jnp.diagonal(cov_q), jnp.diagonal(cov_opt), rtol=0.05
        )
        np.testing.assert_allclose(p["z_scale"] ** 2, var_z, rtol=0.05)
