# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The amortized guide: exact densities, SFVI equal to centralized amortized VI (shared
encoder), SFVI-Avg with private encoders, and what stays on the silos."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.util import log_density
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.densities import data_template
from numpyro_fed.elbo import noise_keys
from numpyro_fed.families import AutoAmortized
from numpyro_fed.protocol import silo_data_of
from numpyro_fed.runtime import simulate_round


def model(y):
    """Groups (silo plate, dim -2) with a random intercept each; nested observations."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with numpyro.plate("group", y.shape[0], dim=-2):
        z = numpyro.sample("z", dist.Normal(mu, tau))
        with numpyro.plate("obs", y.shape[1], dim=-1):
            numpyro.sample("y", dist.Normal(z, 0.5), obs=y)


def features(arrays):
    y = arrays["y"]
    return jnp.stack([y.mean(-1), y.std(-1)], -1)


def make_data(groups=(0, 0, 0, 1, 1, 2)):
    rng = np.random.default_rng(0)
    z = 1.0 + rng.normal(size=(len(groups), 1))
    y = z + 0.5 * rng.normal(size=(len(groups), 4))
    return nf.FederatedData.from_groups(np.asarray(groups), y=jnp.asarray(y))


def setup(shared=True, groups=(0, 0, 0, 1, 1, 2), **kwargs):
    fed = nf.federate(model, silos="group")
    data = make_data(groups)
    guide = AutoAmortized(fed, features=features, hidden=(5,), shared=shared)
    guide.setup(data)
    return fed, guide, data


def random_encoder(guide, key, num_inputs=2):
    return 0.5 * jax.random.normal(key, (guide.encoder_size(num_inputs),))


def test_local_density_is_the_encoders_gaussian():
    """q(z_L) is N(mu_phi(x), sigma_phi(x)^2) with the MLP written out by hand."""
    _, guide, data = setup()
    encoder = random_encoder(guide, jax.random.key(1))
    inputs = features(data.silo(0))
    w1, b1 = encoder[:10].reshape(2, 5), encoder[10:15]
    w2, b2 = encoder[15:25].reshape(5, 2), encoder[25:27]
    out = jax.nn.softplus(inputs @ w1 + b1) @ w2 + b2
    loc, scale = out[:, :1], jax.nn.softplus(out[:, 1:])
    eta_g = {"loc": jnp.zeros(2), "scale": jnp.ones(2), "encoder": encoder}
    eta_l = {"inputs": inputs}
    eps = jax.random.normal(jax.random.key(2), (3, 1))
    z = guide.sample_local(eta_g, eta_l, None, eps)
    np.testing.assert_allclose(z, loc + scale * eps, rtol=1e-12)
    expected = dist.Normal(loc, scale).log_prob(z).sum(-1)
    np.testing.assert_allclose(
        guide.log_q_local(eta_g, eta_l, None, z), expected, rtol=1e-12
    )
    # A fresh encoder gives every unit location 0 and the initial scale.
    fresh = guide.init_global(jax.random.key(0), data_template(data.silo(0)))
    loc0, scale0 = guide.encode(fresh["encoder"], inputs)
    np.testing.assert_allclose(loc0, 0.0)
    np.testing.assert_allclose(scale0, guide.init_scale, rtol=1e-12)


def _pooled_stl_elbo(guide, pooled, key, params):
    """Centralized single-sample STL ELBO on pooled data, with the encoder inside
    log q stopped (spec §3.3), as a function of constrained NumPyro-guide params."""
    eta_g = {k[12:]: v for k, v in params.items() if k.startswith("_fed_global_")}
    eta_l = {k[11:]: v for k, v in params.items() if k.startswith("_fed_local_")}
    stop = jax.lax.stop_gradient
    z_g = guide.sample_global(eta_g, guide.global_noise(key))
    values, log_det = guide.constrain_global(z_g)
    log_q = guide.log_q_global(stop(eta_g), z_g) - log_det
    units = jnp.arange(eta_l["inputs"].shape[0])
    z_l = guide.sample_local(eta_g, eta_l, z_g, guide.local_noise(key, units))
    local, log_det_l = guide.constrain_local(z_l)
    values.update(local)
    log_q = log_q + jnp.sum(
        guide.log_q_local(stop(eta_g), stop(eta_l), z_g, z_l) - log_det_l
    )
    log_p, _ = log_density(guide.model, (), pooled, values)
    return log_p - log_q


def test_shared_encoder_gradient_is_the_pooled_stl_gradient():
    """One SFVI round's summed encoder gradient (server + silos, SGD(1) step) equals
    jax.grad of the centralized STL ELBO on pooled data: the encoder is summed like
    theta, with the stop-gradient rule inside log q."""
    fed, guide, data = setup()
    algorithm = nf.sfvi(fed, guide, optax.sgd(1.0), data_template(data.silo(0)))
    server = jax.jit(algorithm.init_server)(jax.random.key(3))
    server = server._replace(
        eta_global={
            **server.eta_global,
            "encoder": random_encoder(guide, jax.random.key(4)),
        }
    )
    silos = jax.jit(jax.vmap(algorithm.init_silo))(
        jax.random.split(jax.random.key(5), data.num_silos), silo_data_of(data)
    )
    key = noise_keys(jax.random.key(7), 1)
    silo_keys = jnp.broadcast_to(key, (data.num_silos,) + key.shape)
    new_server, _, info = jax.jit(partial(simulate_round, algorithm))(
        server, silos, silo_data_of(data), key, silo_keys
    )
    svi = nf.SFVI(fed, guide, optax.sgd(1.0))
    glob_c, loc_c = guide.param_constraints()
    params = svi.pooled_params(
        svi.get_params(nf.FederatedState(server, silos, key[0])), data
    )
    pooled = partial(_pooled_stl_elbo, guide, data.pooled(), key[0])
    np.testing.assert_allclose(-info.loss, jax.jit(pooled)(params), rtol=1e-10)
    grad = jax.jit(jax.grad(pooled))(params)
    step = new_server.eta_global["encoder"] - server.eta_global["encoder"]
    np.testing.assert_allclose(step, grad["_fed_global_encoder"], rtol=1e-9, atol=1e-12)
    assert np.abs(step).max() > 1e-3  # the encoder does get a gradient


def test_sfvi_with_shared_encoder_equals_numpyro_svi():
    """With Trace_ELBO gradients, SFVI over 3 uneven (padded) silos is centralized
    NumPyro SVI with the same amortized guide, iterate for iterate."""
    fed, guide, data = setup()
    svi = nf.SFVI(fed, guide, optax.adam(0.05), stl=False, reproducible=True)
    state = svi.init(jax.random.key(0), data)
    init = svi.pooled_params(svi.get_params(state), data)
    ref = SVI(fed, guide, optax.adam(0.05), Trace_ELBO())
    ref_state = ref.init(jax.random.key(1), init_params=init, **data.pooled())
    ref_run = ref.run(
        None, 20, progress_bar=False, init_state=ref_state, **data.pooled()
    )
    state = state._replace(rng_key=ref_state.rng_key)
    result = svi.run(None, 20, data, init_state=state, progress_bar=False)
    np.testing.assert_allclose(result.losses, ref_run.losses, rtol=1e-9)
    ours = svi.pooled_params(result.params, data)
    for k, v in ours.items():
        np.testing.assert_allclose(v, ref_run.params[k], rtol=1e-8, atol=1e-10)
    assert (
        np.abs(ours["_fed_global_encoder"] - init["_fed_global_encoder"]).max() > 0.01
    )


def test_private_encoder_sfvi_avg_one_silo_equals_numpyro_svi():
    """A private encoder is a local parameter: with one silo, R rounds of m SFVI-Avg
    steps are R m steps of centralized NumPyro SVI with that guide."""
    fed, guide, data = setup(shared=False, groups=(0,) * 6)
    avg = nf.SFVIAvg(
        fed, guide, optax.adam(0.05), local_steps=4, stl=False, reproducible=True
    )
    state = avg.init(jax.random.key(0), data)

    def numpyro_params(params):
        out = {"_fed_global_" + k: v for k, v in params.eta_global.items()}
        out["_fed_local_inputs"] = params.eta_local["inputs"][0]
        out["_fed_local_encoder"] = params.eta_local["encoder"][0]
        return out

    init = numpyro_params(avg.get_params(state))
    ref = SVI(fed, guide, optax.adam(0.05), Trace_ELBO())
    ref_state = ref.init(jax.random.key(1), init_params=init, **data.pooled())
    ref_run = ref.run(
        None, 20, progress_bar=False, init_state=ref_state, **data.pooled()
    )
    state = state._replace(rng_key=ref_state.rng_key)
    result = avg.run(None, 5, data, init_state=state, progress_bar=False)
    np.testing.assert_allclose(result.losses, ref_run.losses[3::4], rtol=1e-9)
    for k, v in numpyro_params(result.params).items():
        np.testing.assert_allclose(v, ref_run.params[k], rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("cls", ["SFVI", "SFVIAvg"])
def test_private_encoders_and_inputs_never_leave_the_silo(cls):
    """With shared=False the messages carry only the global Gaussian (no encoder, no
    features); each silo trains its own encoder; the stored inputs never move."""
    fed, guide, data = setup(shared=False)
    kwargs = {"local_steps": 5} if cls == "SFVIAvg" else {}
    svi = getattr(nf, cls)(fed, guide, optax.adam(0.05), **kwargs)
    state = svi.init(jax.random.key(0), data)
    algorithm, _ = svi._build(data)
    _, keys, silo_keys = svi._round_keys(state.rng_key, data.num_silos)
    message = algorithm.server_message(state.server, keys)
    first = jax.tree.map(lambda x: x[0], (state.silos, silo_data_of(data)))
    reply, _ = jax.jit(algorithm.silo_step)(message, *first, silo_keys[0])
    eta_reply = reply.grad_eta_global if cls == "SFVI" else reply.eta_global
    assert set(eta_reply) == {"loc", "scale"}
    assert set(message.broadcast.eta_global) == {"loc", "scale"}
    result = svi.run(None, 20, data, init_state=state, progress_bar=False)
    encoders = result.params.eta_local["encoder"]
    assert not np.allclose(encoders[0], encoders[1])
    np.testing.assert_array_equal(
        result.params.eta_local["inputs"], state.silos.eta_local["inputs"]
    )


def test_bad_input():
    fed = nf.federate(model, silos="group")
    data = make_data()
    guide = AutoAmortized(fed, features=lambda a: a["y"].mean(-1))
    with pytest.raises(ValueError, match="2-D"):
        nf.SFVI(fed, guide, optax.adam(0.1)).init(jax.random.key(0), data)
    with pytest.raises(TypeError, match="features must be callable"):
        AutoAmortized(fed, features=None)
    with pytest.raises(ValueError, match="hidden"):
        AutoAmortized(fed, features=features, hidden=(0,))

    def no_globals(y):
        with numpyro.plate("group", y.shape[0], dim=-2):
            z = numpyro.sample("z", dist.Normal(0.0, 1.0))
            numpyro.sample("y", dist.Normal(z, 1.0), obs=y)

    fed = nf.federate(no_globals, silos="group")
    guide = AutoAmortized(fed, features=features)
    with pytest.raises(NotImplementedError, match="shared=False"):
        nf.SFVI(fed, guide, optax.adam(0.1)).init(jax.random.key(0), data)
    private = AutoAmortized(fed, features=features, shared=False)
    nf.SFVI(fed, private, optax.adam(0.1)).run(
        jax.random.key(0), 2, data, progress_bar=False
    )

    def no_locals(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with numpyro.plate("group", y.shape[0], dim=-2):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    fed = nf.federate(no_locals, silos="group")
    with pytest.raises(ValueError, match="needs local latent"):
        nf.SFVI(fed, AutoAmortized(fed, features=features), optax.adam(0.1)).init(
            jax.random.key(0), data
        )


@pytest.mark.parametrize("shared", [True, False], ids=["shared", "private"])
def test_sfvi_avg_and_posterior_draws_with_an_encoder(shared):
    """SFVI-Avg averages a shared encoder like theta (the barycenter covers only the
    Gaussian's parameters); posterior draws come back in the pooled layout."""
    fed, guide, data = setup(shared=shared)
    avg = nf.SFVIAvg(fed, guide, optax.adam(0.05), local_steps=3)
    result = avg.run(jax.random.key(0), 2, data, progress_bar=False)
    if shared:
        assert "encoder" in result.params.eta_global
    draws = avg.sample_posterior(jax.random.key(1), result.params, data, num_samples=5)
    assert draws["z"].shape == (5, data.num_units, 1)
    assert np.all(np.isfinite(np.asarray(draws["z"])))
