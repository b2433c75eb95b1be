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
from numpyro_fed.expfam import GaussianNat, guide_params
from numpyro_fed.infer.pvi_checks import q_movement, warn_unconverged


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


def _history(means, sd=1.0):
    means = np.asarray(means, np.float64)[:, None]
    prec = np.full_like(means, sd**-2)
    return GaussianNat(jnp.asarray(means * prec), jnp.asarray(prec))


def _unconverged(means, average):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_unconverged("PVI", np.zeros(len(means)), _history(means), average)
    return [str(w.message) for w in caught]


def test_an_average_is_judged_by_its_halves_not_by_the_jitter_of_its_rounds():
    # q jumps 0.8 sd every round around 0: the last q is not an answer, the
    # average of 40 rounds is (its halves agree exactly).
    jitter = 0.4 * (-1.0) ** np.arange(40)
    (message,) = _unconverged(jitter, 1)
    assert "over rounds 36-40" in message
    assert _unconverged(jitter, 40) == []
    # a trend of 0.01 sd a round: the halves' averages are 0.2 sd apart
    (message,) = _unconverged(jitter + 0.01 * np.arange(40), 40)
    assert "rounds 1-20" in message and "rounds 21-40" in message
    assert "0.2 sd" in message


def test_run_returns_the_average_of_the_last_rounds_q():
    fit = nf.PVI(nf.federate(_linreg, silos="data"), damping=0.3, average=0.5)
    result = fit.run(jax.random.key(0), 8, _data(), progress_bar=False)
    q = result.history["q"]
    mean = GaussianNat(jnp.mean(q.h[4:], 0), jnp.mean(q.prec[4:], 0))
    expected = guide_params(mean, False)
    for name in ("loc", "scale"):
        np.testing.assert_allclose(
            result.params.eta_global[name], expected[name], rtol=1e-12
        )
    last = fit.get_params(result.state).eta_global["loc"]
    assert not np.allclose(last, expected["loc"], rtol=1e-6)
