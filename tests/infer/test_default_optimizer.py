# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The VI classes' default optimizer (issue 20, item 6): Adam at 0.01, then 1/t."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import numpyro_fed as nf
from numpyro_fed.infer.optim import default_optimizer
from tests import _models as m


def test_rate_is_constant_then_decays_as_one_over_t():
    """Adam's step on a constant gradient is the rate itself (bias-corrected
    moments of a constant are the constant): 0.01 up to step 1,000, then
    0.01 * 1000 / (t + 1)."""
    opt = default_optimizer()
    grads = jnp.ones(1)

    def step(state, _):
        updates, state = opt.update(grads, state)
        return state, updates[0]

    _, steps = jax.lax.scan(step, opt.init(jnp.zeros(1)), length=4000)
    np.testing.assert_allclose(steps[jnp.array([0, 999])], -0.01, rtol=1e-6)
    np.testing.assert_allclose(steps[1999], -0.01 * 1000 / 2000, rtol=1e-6)
    np.testing.assert_allclose(steps[3999], -0.01 * 1000 / 4000, rtol=1e-6)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_bad_rate_is_named(bad):
    with pytest.raises(ValueError, match="learning_rate"):
        default_optimizer(bad)
    with pytest.raises(ValueError, match="constant_steps"):
        default_optimizer(constant_steps=0)


def test_the_vi_classes_use_it_when_given_none():
    """SFVI without an optimizer runs the default one: the same rounds as with
    default_optimizer() given explicitly; SFVIAvg's silos step at its rate."""
    fed = nf.federate(m.normal_normal, silos="group")
    y = np.random.default_rng(0).normal(size=(6, 3)) + 1.0
    data = nf.FederatedData.from_groups(np.array([0, 0, 1, 1, 2, 2]), y=y)
    key = jax.random.key(0)
    runs = [
        nf.SFVI(fed, nf.AutoMeanField(fed), *o).run(key, 3, data, progress_bar=False)
        for o in ((), (default_optimizer(),))
    ]
    np.testing.assert_array_equal(runs[0].losses, runs[1].losses)
    avg = nf.SFVIAvg(fed, nf.AutoMeanField(fed), local_steps=2)
    update, _ = avg.optim.update(jnp.ones(1), avg.optim.init(jnp.zeros(1)))
    np.testing.assert_allclose(update, -0.01, rtol=1e-6)
