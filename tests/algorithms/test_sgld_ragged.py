# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""FSGLD and DSGLD on ragged nested plates (issue 19): one county per silo, homes
nested in it; the padded homes contribute exactly nothing to the potential."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC
import pytest

import numpyro_fed as nf
from numpyro_fed.potentials import federated_potential
from numpyro_fed.protocol import silo_data_of
from tests.test_valid_models import HOMES, _radon_silos, radon, radon_flat, radon_latent


def _silo(data, j):
    return {k: v[j] for k, v in data.arrays.items()}


@pytest.mark.parametrize("latent", [False, True], ids=["radon", "latent-per-home"])
def test_padded_potential_equals_each_silo_unpadded(latent, enable_x64):
    """Prior and every silo's term, with their gradients, equal those of the silo's
    own unpadded data (float64, 1e-12); junk at padded homes changes nothing and
    gets a zero gradient."""
    fed = nf.federate(radon_latent if latent else radon, silos="county")
    silos = _radon_silos()
    data = nf.FederatedData.from_silos(silos)
    pot = federated_potential(fed, data)
    np.testing.assert_array_equal(pot.nested["home"], HOMES)
    rng = np.random.default_rng(7)
    z_global = {
        s.name: jnp.asarray(rng.normal(size=s.unconstrained_shape))
        for s in pot.global_sites
    }
    width = data.arrays["floor"].shape[-1]
    for j in (0, 3, 4):  # one home, the widest county, three homes
        own_data = nf.FederatedData.from_silos([silos[j]])
        own = federated_potential(fed, own_data)
        assert own.nested == {}
        n = HOMES[j]
        z_own = {"a": jnp.asarray(rng.normal(size=(1, 1)))}
        z_pad = dict(z_own)
        if latent:
            z_own["z"] = jnp.asarray(rng.normal(size=(1, n)))
            junk = 1e3 * rng.normal(size=(1, width - n))
            z_pad["z"] = jnp.concatenate([z_own["z"], jnp.asarray(junk)], -1)
        nested = {k: v[j] for k, v in pot.nested.items()}
        grad = jax.value_and_grad(pot.silo_log_likelihood, argnums=(0, 1))
        value, (g_global, g_local) = grad(
            z_global, z_pad, _silo(data, j), data.mask[j], nested
        )
        ref, (r_global, r_local) = grad(z_global, z_own, own_data.silo(0), None)
        np.testing.assert_allclose(value, ref, rtol=1e-12)
        for name in z_global:
            np.testing.assert_allclose(g_global[name], r_global[name], rtol=1e-12)
        np.testing.assert_allclose(g_local["a"], r_local["a"], rtol=1e-12)
        if latent:
            np.testing.assert_allclose(g_local["z"][:, :n], r_local["z"], rtol=1e-12)
            assert np.all(np.asarray(g_local["z"][:, n:]) == 0.0)
            real = pot.real_local(z_pad, data.mask[j], nested)["z"]
            assert int(real.sum()) == n and bool(real[0, :n].all())
        # a one-unit minibatch of the silo is the whole silo here
        batch = pot.minibatch_log_likelihood(
            z_global, z_pad, _silo(data, j), jnp.array([0]), 1, nested
        )
        np.testing.assert_allclose(batch, ref, rtol=1e-12)
        np.testing.assert_allclose(
            pot.log_prior(z_global), own.log_prior(z_global), rtol=1e-12
        )


def test_dsgld_drift_averages_to_the_pooled_gradient(enable_x64):
    """A latent per home: the silos' drifts, weighted by the visit probabilities,
    sum to the gradient of NumPyro's potential on the ragged data as they are (a
    flat model with one row per home); each silo's local gradient is that
    potential's gradient at its county's and homes' latents, and zero at padded
    homes."""
    from numpyro.infer.util import potential_energy

    from numpyro_fed.algorithms.sgld import Minibatch, silo_estimator

    fed = nf.federate(radon_latent, silos="county")
    silos = _radon_silos()
    data = nf.FederatedData.from_silos(silos)
    f = np.array(HOMES) / sum(HOMES)
    kernel = nf.DSGLD(fed, 1e-4, silo_probs=f)
    pot, cfg = kernel.potential(data), kernel.config(data)
    z = pot.init_position(jax.random.key(0), data)
    z_global, z_local = pot.split(z)
    z_local["z"] = jnp.where(data.mask[:, :, None], z_local["z"], 1e3)  # junk pads
    homes = np.concatenate([np.full(n, j) for j, n in enumerate(HOMES)])
    pooled = {
        "county": homes,
        "floor": np.concatenate([s["floor"][0] for s in silos]),
        "log_radon": np.concatenate([s["log_radon"][0] for s in silos]),
        "latent": True,
    }
    flat = {
        **z_global,
        "a": z_local["a"][:, 0, 0],
        "z": jnp.concatenate([z_local["z"][j, 0, :n] for j, n in enumerate(HOMES)]),
    }
    ref = jax.grad(lambda p: -potential_energy(radon_flat, (), pooled, p))(flat)
    theta = pot.flatten(z_global)

    def drift(j, silo, local):
        batch = Minibatch(silo.arrays, silo.mask, None, silo.nested)
        return silo_estimator(pot, cfg, j)((theta, local), batch)

    silos_data = silo_data_of(data, pot.nested)
    psi, g_local = jax.jit(jax.vmap(drift))(jnp.arange(len(HOMES)), silos_data, z_local)
    np.testing.assert_allclose(g_local["a"][:, 0, 0], ref["a"], rtol=1e-10)
    start = 0
    for j, n in enumerate(HOMES):
        np.testing.assert_allclose(
            g_local["z"][j, 0, :n], ref["z"][start : start + n], rtol=1e-10
        )
        assert np.all(np.asarray(g_local["z"][j, 0, n:]) == 0.0)
        start += n
    total = jnp.sum(jnp.asarray(f)[:, None] * psi, 0)
    np.testing.assert_allclose(total, pot.flatten(ref), rtol=1e-10)


def ragged_normal(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("county", y.shape[0], dim=-2):
        with numpyro.plate("home", y.shape[1], dim=-1):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def test_fsgld_on_ragged_homes_samples_the_exact_posterior():
    """Conjugate model, homes ragged across counties: each silo's Laplace surrogate
    has precision its own number of homes (not the padded 116), so the conducive
    gradient makes every silo's drift exact and FSGLD's draws match the closed-form
    posterior (Langevin with step h inflates the variance by 1/(1 - h P / 4))."""
    silos = _radon_silos()
    ys = [s["log_radon"] for s in silos]
    data = nf.FederatedData.from_silos([{"y": y} for y in ys])
    fed = nf.federate(ragged_normal, silos="county")
    q = nf.fit_surrogates(fed, data, method="laplace")
    np.testing.assert_allclose(q.prec[:, 0, 0], HOMES, rtol=1e-8)
    precision = sum(HOMES) + 1e-2
    mean = sum(float(y.sum()) for y in ys) / precision
    h = 1e-3
    kernel = nf.FSGLD(fed, h, q, tau=5)
    mcmc = MCMC(kernel, num_warmup=500, num_samples=12000, progress_bar=False)
    mcmc.run(jax.random.key(0), data)
    draws = np.asarray(mcmc.get_samples()["mu"])
    sd = (precision * (1 - h * precision / 4)) ** -0.5
    # The chain's autocorrelation time is about 2 / (h P) = 11 steps: 12,000 draws
    # give a standard error of about sd / 33; a padded home counted as data (edge
    # values repeated) moves the mean by several posterior sds.
    assert abs(draws.mean() - mean) < 4 * sd / 33
    assert abs(draws.std() / sd - 1) < 0.1


def test_dsgld_runs_on_the_radon_model_with_a_latent_per_home():
    """The unedited model, one county per silo: finite draws, and the latents of
    padded homes (which carry no density) never move. (FSGLD's surrogates are
    checked on a conjugate model above: a per-silo Laplace fit of this model has
    no mode, its density growing without bound as sigma_y shrinks.)"""
    fed = nf.federate(radon_latent, silos="county")
    data = nf.FederatedData.from_silos(_radon_silos())
    kernel = nf.DSGLD(fed, 1e-4, tau=2, local_steps=0)  # the joint step
    mcmc = MCMC(kernel, num_warmup=0, num_samples=200, progress_bar=False)
    mcmc.run(jax.random.key(0), data)
    draws = mcmc.get_samples()
    assert all(np.isfinite(np.asarray(v)).all() for v in draws.values())
    z = np.asarray(draws["z"])  # (draws, county, padded homes)
    moved = 0
    for j, n in enumerate(HOMES):
        assert np.all(z[:, j, n:] == z[:1, j, n:])
        moved += bool(np.any(z[:, j, :n] != z[:1, j, :n]))
    assert moved >= 5  # the real homes of the counties the chain visited
