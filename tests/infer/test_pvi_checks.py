# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The run-time check that PVI's q has settled at its fixed point (issue 22)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_fed as nf
from numpyro_fed.infer.pvi_checks import q_movement


def _linreg(X, y):
    w = numpyro.sample("w", dist.Normal(jnp.zeros(2), 1.0).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Normal(X @ w, 0.5), obs=y)


def _data():
    rng = np.random.default_rng(0)
    X = rng.normal(size=(40, 2))
    y = X @ np.array([1.0, -0.5]) + 0.5 * rng.normal(size=40)
    return nf.FederatedData.from_groups(np.repeat(np.arange(4), 10), X=X, y=y)


def test_q_movement_measures_mean_in_sds_and_sd_in_log_ratio():
    means = np.array([[0.5, 5.0], [0.3, 5.0], [0.1, 5.0]])
    sds = np.array([[2.0, 1.0], [2.0, 1.0], [2.0, 1.0]])
    assert q_movement(means, sds, 2) == pytest.approx((0.1, 0, "mean"))
    assert q_movement(means, sds, 3) == pytest.approx((0.2, 0, "mean"))
    sds[1, 1] = np.e
    assert q_movement(means, sds, 3) == pytest.approx((1.0, 1, "sd"))
    assert q_movement(means[:1], sds[:1], 1) == (0.0, 0, "mean")


def _fixed_point_warnings(rounds, damping):
    fit = nf.PVI(nf.federate(_linreg, silos="data"), damping=damping)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fit.run(jax.random.key(0), rounds, _data(), progress_bar=False)
    return [str(w.message) for w in caught if "fixed point" in str(w.message)]


def test_warns_on_a_run_stopped_before_its_fixed_point():
    (message,) = _fixed_point_warnings(6, 0.1)
    assert "over rounds 2-6" in message and "local_steps" in message


def test_quiet_on_a_converged_conjugate_run():
    # Gaussian likelihood: the natural solver is exact, damping 1/2 halves the
    # distance to the fixed point every round.
    assert _fixed_point_warnings(40, 0.5) == []
