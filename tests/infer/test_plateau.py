# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""``run(..., stop=Plateau(...))``: a run ends at the first window end where its loss
stopped moving, the same round in both run modes, and resumes to the same end."""

import jax
import numpy as np
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.infer.rounds import Plateau, loss_drift
from tests.infer.test_driver import ALGORITHMS, _logistic


def test_rule_on_known_sequences():
    rule = Plateau(window=10, rtol=1e-3)
    falling = np.linspace(100.0, 50.0, 40)
    assert not rule.reached(falling)
    flat = np.concatenate([falling, np.full(20, 50.0)])
    assert rule.reached(flat)
    assert not rule.reached(flat[:-1])  # not at a window's end
    noise = np.random.default_rng(0).normal(0.0, 1.0, 40) + 1e3
    assert Plateau(window=20, rtol=0.0).reached(noise)  # a change within the noise
    trend = noise - np.arange(40.0)  # a drop of 20 per window, noise of sd 1
    assert not Plateau(window=20, rtol=0.0).reached(trend)


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_run_stops_at_the_same_round_in_both_modes(name):
    fed, data = _logistic(3)
    obj = ALGORITHMS[name](fed)
    rule = Plateau(window=25, rtol=1e-3)
    scanned = obj.run(jax.random.key(1), 5000, data, progress_bar=False, stop=rule)
    looped = obj.run(jax.random.key(1), 5000, data, progress_bar=True, stop=rule)
    n = len(scanned.losses)
    assert 50 <= n < 5000 and n % 25 == 0
    assert rule.reached(scanned.losses)
    assert not any(rule.reached(scanned.losses[:k]) for k in range(50, n, 25))
    np.testing.assert_allclose(looped.losses, scanned.losses, rtol=1e-5)
    assert len(scanned.history["bytes_up"]) == n


def test_resumed_run_stops_where_the_whole_run_stops(tmp_path):
    fed, data = _logistic(3)
    svi = nf.SFVI(fed, nf.AutoMeanField(fed), optax.adam(0.05))
    rule = Plateau(window=20, rtol=1e-3)
    key = jax.random.key(2)
    whole = svi.run(key, 4000, data, progress_bar=False, stop=rule)
    assert len(whole.losses) > 40
    svi.run(key, 40, data, progress_bar=False, checkpoint_dir=tmp_path)
    resumed = svi.run(
        key,
        4000,
        data,
        progress_bar=False,
        checkpoint_dir=tmp_path,
        resume=True,
        stop=rule,
    )
    np.testing.assert_array_equal(resumed.losses, whole.losses)


def test_bad_rule_is_named():
    fed, data = _logistic(2)
    svi = nf.SFVI(fed, nf.AutoMeanField(fed), optax.adam(0.05))
    with pytest.raises(TypeError, match="Plateau"):
        svi.run(jax.random.key(0), 10, data, stop=0.01)
    with pytest.raises(ValueError, match="window"):
        svi.run(jax.random.key(0), 10, data, stop=Plateau(window=1))


def test_drift_flags_a_rise_beyond_the_noise_only():
    rng = np.random.default_rng(3)
    noise = rng.normal(0.0, 1.0, 100)
    falling = np.linspace(200.0, 100.0, 100) + noise
    assert loss_drift(falling, 10) == (0.0, 0.0)
    flat = 100.0 + noise
    assert loss_drift(flat, 10)[1] < 4  # the best of 9 noisy windows is not a drift
    rising = np.r_[falling, 100.0 + np.linspace(0, 20, 50) + rng.normal(0, 1, 50)]
    rise, z = loss_drift(rising, 10)
    assert 15 < rise < 21 and z > 20


def test_exact_pvi_run_does_not_warn_of_drift():
    """The natural solver on a logistic regression converges: no false alarm."""
    import warnings

    fed, data = _logistic(3)
    pvi = nf.PVI(fed, schedule="sequential")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pvi.run(jax.random.key(0), 30, data, progress_bar=False)
