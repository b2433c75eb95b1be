# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""SFVI-Avg (seed 000 spec §6.2: T4, T8, T10) and its exact conjugate case."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import SVI, Trace_ELBO
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.families.gaussian import unit_tril
from numpyro_fed.protocol import silo_data_of
from tests import _models as m


def test_one_silo_rounds_equal_centralized_steps():
    """T4: J = 1, R rounds of m local steps with the optimizer state carried over
    equal R m steps of centralized NumPyro SVI, draw for draw."""
    fed = nf.federate(m.hierarchical, silos="group")
    data = nf.FederatedData.from_groups(np.zeros(7, int), **m.hierarchical_data())
    guide = nf.AutoGlobalLocalNormal(fed, local_cov="full")
    avg = nf.SFVIAvg(
        fed, guide, optax.adam(0.05), local_steps=4, stl=False, reproducible=True
    )
    state = avg.init(jax.random.key(0), data)
    ref = SVI(fed, guide, optax.adam(0.05), Trace_ELBO())
    init = avg.pooled_params(avg.get_params(state), data)
    ref_state = ref.init(jax.random.key(1), init_params=init, **data.pooled())
    ref_run = ref.run(
        None, 20, progress_bar=False, init_state=ref_state, **data.pooled()
    )
    state = state._replace(rng_key=ref_state.rng_key)
    result = avg.run(None, 5, data, init_state=state, progress_bar=False)
    # Each round reports the surrogate loss of its last local step.
    np.testing.assert_allclose(result.losses, ref_run.losses[3::4], rtol=1e-9)
    ours = avg.pooled_params(result.params, data)
    for k, v in ours.items():
        ref_v = ref_run.params[k]
        if k.endswith("tril"):  # only the strictly lower part is a parameter
            v, ref_v = unit_tril(v), unit_tril(ref_v)
        np.testing.assert_allclose(v, ref_v, rtol=1e-8, atol=1e-10)


def test_scaled_surrogate_gradient_equals_pooled_gradient():
    """T10: with no local latents and J silos holding identical data, one local step
    of each silo moves (theta, eta_G) exactly as one SFVI round on the pooled data
    (the pooled log-likelihood is J = N / N_j times a silo's)."""
    arrays = m.logistic_data(num_rows=10)
    copies = {k: jnp.concatenate([v] * 3) for k, v in arrays.items()}
    groups = np.repeat(np.arange(3), 10)
    data = nf.FederatedData.from_groups(groups, **copies)
    fed = nf.federate(m.logistic, silos="data")
    sgd = optax.sgd(1.0)
    # the silos draw the server's noise: the same draws as the pooled round
    avg = nf.SFVIAvg(
        fed, nf.AutoGlobalLocalNormal(fed), sgd, local_steps=1, reproducible=True
    )
    sfvi = nf.SFVI(fed, nf.AutoGlobalLocalNormal(fed), sgd, reproducible=True)
    state = sfvi.init(jax.random.key(0), data)
    avg_state = avg.init(jax.random.key(0), data, init_params=sfvi.get_params(state))
    stepped, _ = sfvi.update(state, data)
    algorithm, _ = avg._build(data)
    _, keys, silo_keys = avg._round_keys(avg_state.rng_key, data.num_silos)
    message = algorithm.server_message(avg_state.server, keys)
    replies, _ = jax.vmap(algorithm.silo_step, in_axes=(None, 0, 0, 0))(
        message, avg_state.silos, silo_data_of(data), silo_keys
    )
    for j in range(3):
        for k in stepped.server.eta_global:
            np.testing.assert_allclose(
                replies.eta_global[k][j], stepped.server.eta_global[k], rtol=1e-10
            )


def test_conjugate_normal_mean_is_exact():
    """Known-variance normal mean, equal silos, no local latents: every silo's scaled
    surrogate posterior has the exact posterior's sd and the silo means average to
    the exact mean, so the W2 barycenter is the exact posterior."""

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
        with numpyro.plate("data", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    y = jnp.asarray(np.random.default_rng(0).normal(1.0, 1.0, 40))
    data = nf.FederatedData.from_groups(np.arange(40) % 4, y=y)
    fed = nf.federate(model, silos="data")
    # STL has zero variance at the exact optimum, so each silo reaches its surrogate
    # optimum with a constant step; one round then suffices, a second must not move.
    avg = nf.SFVIAvg(fed, nf.AutoMeanField(fed), optax.adam(0.02), local_steps=1500)
    params = avg.run(jax.random.key(0), 2, data, progress_bar=False).params
    precision = 1 / 4 + 40
    np.testing.assert_allclose(
        params.eta_global["loc"][0], y.sum() / precision, atol=1e-4
    )
    np.testing.assert_allclose(
        params.eta_global["scale"][0], precision**-0.5, rtol=1e-3
    )


def test_silo_message_carries_no_unit_dimension():
    """T8 for SFVI-Avg: a silo sends (theta_j, eta_G,j), its ELBO and N_j only."""
    fed = nf.federate(m.hierarchical, silos="group")
    data = nf.FederatedData.from_groups(np.arange(7) % 2, **m.hierarchical_data())
    avg = nf.SFVIAvg(
        fed, nf.AutoGlobalLocalNormal(fed), optax.adam(0.05), local_steps=2
    )
    state = avg.init(jax.random.key(0), data)
    algorithm, _ = avg._build(data)
    _, keys, silo_keys = avg._round_keys(state.rng_key, data.num_silos)
    message = algorithm.server_message(state.server, keys)
    reply, _ = algorithm.silo_step(
        message,
        jax.tree.map(lambda x: x[0], state.silos),
        jax.tree.map(lambda x: x[0], silo_data_of(data)),
        silo_keys[0],
    )
    assert type(reply)._fields == ("theta", "eta_global", "elbo", "num_units")
    for leaf in jax.tree.leaves(reply) + jax.tree.leaves(message):
        assert data.padded_size not in jnp.shape(leaf)


def _one_round(lr, num_silos=4):
    """One SFVI round and one SFVI-Avg(1) round from the same state, SGD, same noise."""
    arrays = m.logistic_data(num_rows=40)
    data = nf.FederatedData.from_groups(np.arange(40) % num_silos, **arrays)
    fed = nf.federate(m.logistic, silos="data")
    sfvi = nf.SFVI(fed, nf.AutoMeanField(fed), optax.sgd(lr), reproducible=True)
    avg = nf.SFVIAvg(
        fed, nf.AutoMeanField(fed), optax.sgd(lr), local_steps=1, reproducible=True
    )
    state = sfvi.init(jax.random.key(0), data)
    avg_state = avg.init(jax.random.key(0), data, init_params=sfvi.get_params(state))
    one, _ = sfvi.update(state, data)
    other, _ = avg.update(avg_state, data)
    return sfvi.get_params(state), sfvi.get_params(one), avg.get_params(other)


@pytest.mark.slow
def test_sfvi_avg_one_step_is_sfvi_up_to_the_scale_parameterization():
    """T9: with SGD, equal N_j, no local latents, a diagonal Gaussian and shared noise,
    the averaged mean update of SFVI-Avg(1) is SFVI's update exactly (both linear in the
    silo gradients). The scale is averaged after a softplus, so it agrees to second
    order in the step: shrinking the step 10x shrinks the gap about 100x."""
    _, sfvi, avg = _one_round(1e-2)
    np.testing.assert_allclose(
        avg.eta_global["loc"], sfvi.eta_global["loc"], rtol=1e-12
    )
    gaps = []
    for lr in (1e-2, 1e-3):
        start, sfvi, avg = _one_round(lr)
        step = jnp.max(jnp.abs(sfvi.eta_global["scale"] - start.eta_global["scale"]))
        gap = jnp.max(jnp.abs(avg.eta_global["scale"] - sfvi.eta_global["scale"]))
        assert gap < 0.1 * step
        gaps.append(gap)
    assert 50 < gaps[0] / gaps[1] < 200


def test_silos_too_small_for_the_scaling_are_named_in_a_warning():
    """One group per silo cannot identify mu (2) and tau: SFVIAvg says so, naming
    the silos; silos of 4 rows for 3 coefficients pass silently."""
    import warnings

    fed = nf.federate(m.hierarchical, silos="group")
    data = nf.FederatedData.from_groups(np.arange(7), **m.hierarchical_data())
    avg = nf.SFVIAvg(fed, nf.AutoMeanField(fed), optax.adam(0.05), local_steps=2)
    with pytest.warns(UserWarning, match=r"silo\(s\) 0, 1, 2, 3, 4 and 2 more.*\(3\)"):
        avg.init(jax.random.key(0), data)
    logistic = nf.federate(m.logistic, silos="data")
    rows = nf.FederatedData.from_groups(
        np.arange(40) % 10, **m.logistic_data(num_rows=40)
    )
    avg = nf.SFVIAvg(
        logistic, nf.AutoMeanField(logistic), optax.adam(0.05), local_steps=2
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        avg.init(jax.random.key(0), rows)


def test_ott_barycenter_backend_gives_the_same_run():
    """``barycenter="ott"`` (ott-jax's Bures barycenter, 50 iterations) reproduces the
    default run with full-covariance global Gaussians: each server step's barycenters
    agree to ~1e-14 relative (tests/test_aggregate.py); 4 rounds of 3 Adam steps
    amplify that to at most ~1e-12 here, so rtol 1e-9 is loose yet would catch
    a wrong weighting or an unconverged barycenter (ott's 5 iterations: ~1e-5)."""
    pytest.importorskip("ott")
    data = nf.FederatedData.from_groups(
        np.arange(40) % 4, **m.logistic_data(num_rows=40)
    )
    fed = nf.federate(m.logistic, silos="data")
    params = {}
    for backend in ("fixed_point", "ott"):
        guide = nf.AutoGlobalLocalNormal(fed)
        assert guide.global_cov == "full"
        avg = nf.SFVIAvg(
            fed, guide, optax.adam(0.05), local_steps=3, barycenter=backend
        )
        result = avg.run(jax.random.key(0), 4, data, progress_bar=False)
        params[backend] = result.params.eta_global
    ours, ott = params["fixed_point"], params["ott"]
    assert ours["tril"].size > 1  # a full covariance: the iterative barycenter ran
    for k in ours:
        np.testing.assert_allclose(ott[k], ours[k], rtol=1e-9, atol=1e-12)


def test_unknown_barycenter_backend_is_named():
    fed = nf.federate(m.logistic, silos="data")
    with pytest.raises(ValueError, match="barycenter must be one of"):
        nf.SFVIAvg(
            fed,
            nf.AutoGlobalLocalNormal(fed),
            optax.adam(0.05),
            local_steps=2,
            barycenter="bures",
        )


def test_answer_away_from_the_full_elbo_optimum_warns():
    """Normal mean, two silos of two rows. Equal noise: the silos mirror each other,
    SFVIAvg's answer is the posterior and the run is silent. Noise sd 1 in one silo
    and 3 in the other: the exact posterior mean is 0.4 (sd 0.67), the barycenter of
    the silos' fits sits near 2, and the run warns."""
    import warnings

    def model(y, noise):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("data", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, noise), obs=y)

    fed = nf.federate(model, silos="data")
    y = jnp.array([0.0, 0.0, 4.0, 4.0])

    def run(noise):
        data = nf.FederatedData.from_groups([0, 0, 1, 1], y=y, noise=noise)
        avg = nf.SFVIAvg(fed, nf.AutoMeanField(fed), optax.adam(0.05), local_steps=50)
        return avg.run(jax.random.key(0), 40, data, progress_bar=False)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = run(jnp.ones(4))
    assert abs(float(result.params.eta_global["loc"][0]) - 8 / 4.01) < 0.05
    with pytest.warns(UserWarning, match=r"SFVIAvg: the answer is not at the full"):
        result = run(jnp.array([1.0, 1.0, 3.0, 3.0]))
    assert float(result.params.eta_global["loc"][0]) > 1.0
