# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Ordinary NumPyro models that federated inference must run unedited (issue 19)."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import numpyro_fed as nf
from tests import _models as m

# Rubin's eight schools: the known standard errors are data in a scale parameter.
SCHOOLS_Y = np.array([28.0, 8.0, -3.0, 7.0, -1.0, 1.0, 18.0, 12.0])
SCHOOLS_SIGMA = np.array([15.0, 10.0, 16.0, 11.0, 9.0, 11.0, 10.0, 18.0])


def eight_schools(sigma, y=None):
    mu = numpyro.sample("mu", dist.Normal(0.0, 5.0))
    tau = numpyro.sample("tau", dist.HalfCauchy(5.0))
    with numpyro.plate("school", sigma.shape[0]):
        theta = numpyro.sample("theta", dist.Normal(mu, tau))
        numpyro.sample("obs", dist.Normal(theta, sigma), obs=y)


def _schools():
    fed = nf.federate(eight_schools, silos="school")
    data = nf.FederatedData.from_groups(np.arange(8), sigma=SCHOOLS_SIGMA, y=SCHOOLS_Y)
    return fed, data


@pytest.mark.parametrize(
    "make",
    [
        lambda fed: nf.SFVI(fed, nf.AutoGlobalLocalNormal(fed), optax.adam(0.05)),
        lambda fed: nf.SFVIAvg(
            fed, nf.AutoGlobalLocalNormal(fed), optax.adam(0.05), local_steps=3
        ),
        lambda fed: nf.PVI(fed, nf.AutoMeanField(fed), optax.adam(0.05), local_steps=3),
    ],
    ids=["sfvi", "sfvi_avg", "pvi"],
)
def test_data_in_a_scale_parameter_sets_up_and_runs(make):
    """The known per-school sd is data in Normal's scale: set-up must not invent
    values for it (an all-zero copy fails NumPyro's argument check)."""
    fed, data = _schools()
    algorithm = make(fed)
    result = algorithm.run(jax.random.key(0), 5, data, progress_bar=False)
    assert np.isfinite(np.asarray(result.losses)).all()
    for leaf in jax.tree.leaves(result.params):
        assert np.isfinite(np.asarray(leaf)).all()


def test_data_in_a_scale_parameter_sfvi_equals_numpyro_svi():
    """SFVI, one school per silo, equals centralized NumPyro SVI with the same guide,
    iterate for iterate (float64, reproducible noise)."""
    fed, data = _schools()
    guide = nf.AutoGlobalLocalNormal(fed)
    svi = nf.SFVI(fed, guide, optax.adam(0.05), stl=False, reproducible=True)
    state, ref = m.numpyro_svi_reference(fed, guide, svi, data, 20, optax.adam(0.05))
    result = svi.run(None, 20, data, init_state=state, progress_bar=False)
    np.testing.assert_allclose(result.losses, ref.losses, rtol=1e-9)
    ours = svi.pooled_params(result.params, data)
    m.tree_allclose(ours, {k: ref.params[k] for k in ours}, rtol=1e-8, atol=1e-10)


# A conjugate model whose prior has a term outside any site: mu ~ N(0, 10^2) times the
# factor N(mu; 1, 0.5^2), then y_i ~ N(mu, 1).
FACTOR_Y = np.array([0.3, 1.2, -0.4, 2.0, 0.9, 1.5, 0.1, 1.1])


def factor_prior(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    numpyro.factor("prior_term", dist.Normal(1.0, 0.5).log_prob(mu))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def _factor_posterior():
    precision = 1 / 10.0**2 + 1 / 0.5**2 + len(FACTOR_Y)
    return (1.0 / 0.5**2 + FACTOR_Y.sum()) / precision, precision**-0.5


def test_global_factor_sfvi_equals_numpyro_svi():
    """A numpyro.factor outside the silo plate is a prior term of the server's: SFVI
    equals centralized NumPyro SVI on the same model, iterate for iterate."""
    fed = nf.federate(factor_prior, silos="data")
    data = nf.FederatedData.from_groups(m.split_groups(8, 3), y=FACTOR_Y)
    guide = nf.AutoGlobalLocalNormal(fed)
    svi = nf.SFVI(fed, guide, optax.adam(0.05), stl=False, reproducible=True)
    state, ref = m.numpyro_svi_reference(fed, guide, svi, data, 20, optax.adam(0.05))
    result = svi.run(None, 20, data, init_state=state, progress_bar=False)
    np.testing.assert_allclose(result.losses, ref.losses, rtol=1e-9)
    ours = svi.pooled_params(result.params, data)
    m.tree_allclose(ours, {k: ref.params[k] for k in ours}, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("algorithm", ["sfvi", "pvi"])
def test_global_factor_gives_the_exact_posterior(algorithm):
    """The factor counts once, in the closed-form Gaussian posterior."""
    fed = nf.federate(factor_prior, silos="data")
    data = nf.FederatedData.from_groups(m.split_groups(8, 3), y=FACTOR_Y)
    mean, sd = _factor_posterior()
    if algorithm == "sfvi":
        schedule = optax.exponential_decay(0.05, 500, 0.5)
        svi = nf.SFVI(
            fed, nf.AutoGlobalLocalNormal(fed), optax.adam(schedule), num_particles=4
        )
        params = svi.run(jax.random.key(0), 3000, data, progress_bar=False).params
        tol = 5e-3
    else:
        # The factor hides the prior's form, so PVI refines it stochastically: the
        # tolerance covers that noise, and a dropped factor (sd 0.353) fails it.
        pvi = nf.PVI(
            fed,
            nf.AutoMeanField(fed),
            optax.adam(0.02),
            local_steps=300,
            num_particles=8,
        )
        params = pvi.run(jax.random.key(0), 60, data, progress_bar=False).params
        tol = 2e-2
    np.testing.assert_allclose(params.eta_global["loc"][0], mean, atol=tol)
    np.testing.assert_allclose(params.eta_global["scale"][0], sd, atol=tol)


# Radon-like data: one county per silo, homes nested in it, 1 to 116 homes a county.
HOMES = [1, 2, 5, 116, 3, 9, 1, 27, 14, 4]


def radon(floor, log_radon=None):
    mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 10.0))
    sigma_a = numpyro.sample("sigma_a", dist.HalfNormal(5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 10.0))
    sigma_y = numpyro.sample("sigma_y", dist.HalfNormal(5.0))
    with numpyro.plate("county", floor.shape[0], dim=-2):
        a = numpyro.sample("a", dist.Normal(mu_a, sigma_a))
        with numpyro.plate("home", floor.shape[1], dim=-1):
            numpyro.sample("y", dist.Normal(a + b * floor, sigma_y), obs=log_radon)


def radon_latent(floor, log_radon=None):
    """A latent per home (its true level), observed with noise."""
    mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 10.0))
    b = numpyro.sample("b", dist.Normal(0.0, 10.0))
    sigma_y = numpyro.sample("sigma_y", dist.HalfNormal(5.0))
    with numpyro.plate("county", floor.shape[0], dim=-2):
        a = numpyro.sample("a", dist.Normal(mu_a, 1.0))
        with numpyro.plate("home", floor.shape[1], dim=-1):
            z = numpyro.sample("z", dist.Normal(a + b * floor, 0.3))
            numpyro.sample("y", dist.Normal(z, sigma_y), obs=log_radon)


def radon_flat(county, floor, log_radon, latent=False):
    """The same models on the ragged data as they are: one row per home."""
    mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 10.0))
    sigma_a = 1.0 if latent else numpyro.sample("sigma_a", dist.HalfNormal(5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 10.0))
    sigma_y = numpyro.sample("sigma_y", dist.HalfNormal(5.0))
    with numpyro.plate("counties", len(HOMES)):
        a = numpyro.sample("a", dist.Normal(mu_a, sigma_a))
    with numpyro.plate("homes", len(county)):
        mean = a[county] + b * floor
        if latent:
            mean = numpyro.sample("z", dist.Normal(mean, 0.3))
        numpyro.sample("y", dist.Normal(mean, sigma_y), obs=log_radon)


def _radon_silos(seed=0):
    rng = np.random.default_rng(seed)
    silos = []
    for j, n in enumerate(HOMES):
        floor = (rng.uniform(size=n) < 0.3).astype(np.float64)
        y = 1.3 + 0.2 * j - 0.6 * floor + 0.7 * rng.normal(size=n)
        silos.append({"floor": floor[None], "log_radon": y[None]})
    return silos


def test_ragged_nested_plate_needs_no_mask_in_the_model():
    """The library finds the real size of the nested plate in each silo."""
    fed = nf.federate(radon, silos="county")
    data = nf.FederatedData.from_silos(_radon_silos())
    roles = nf.partition.analyze(fed, data)
    nested = nf.partition.nested_sizes(fed, data, roles)
    assert list(nested) == ["home"]
    np.testing.assert_array_equal(nested["home"], HOMES)


@pytest.mark.parametrize("latent", [False, True], ids=["radon", "latent-per-home"])
def test_ragged_nested_log_density_equals_pooled(latent):
    """Server term plus every padded silo's term equals the log density of the
    ragged data as they are (a flat model with one row per home), to 1e-10; padded
    homes (with absurd latent values there) contribute exactly nothing."""
    from numpyro.infer.util import log_density

    from numpyro_fed.densities import (
        data_template,
        server_log_density,
        silo_log_density,
    )

    model = radon_latent if latent else radon
    fed = nf.federate(model, silos="county")
    silos = _radon_silos()
    data = nf.FederatedData.from_silos(silos)
    nested = nf.partition.nested_sizes(fed, data, nf.partition.analyze(fed, data))
    rng = np.random.default_rng(3)
    values = {"mu_a": 1.1, "b": -0.4, "sigma_y": 0.8}
    if not latent:
        values["sigma_a"] = 0.6
    a = rng.normal(size=len(HOMES))
    homes = np.concatenate([np.full(n, j) for j, n in enumerate(HOMES)])
    z = rng.normal(size=len(homes))
    padded_z = np.full((len(HOMES), 1, data.arrays["floor"].shape[-1]), 1e3)
    for j, n in enumerate(HOMES):
        padded_z[j, 0, :n] = z[homes == j]
    total = server_log_density(fed, "county", data_template(data.silo(0)), values)
    for j in range(len(HOMES)):
        local = {"a": jnp.full((1, 1), a[j])}
        if latent:
            local["z"] = jnp.asarray(padded_z[j])
        total += silo_log_density(
            fed,
            "county",
            {k: v[j] for k, v in data.arrays.items()},
            data.mask[j],
            {**values, **local},
            nested={"home": nested["home"][j]},
        )
    pooled = {
        "county": homes,
        "floor": np.concatenate([s["floor"][0] for s in silos]),
        "log_radon": np.concatenate([s["log_radon"][0] for s in silos]),
        "latent": latent,
    }
    flat_values = {**values, "a": a, **({"z": z} if latent else {})}
    expected, _ = log_density(radon_flat, (), pooled, flat_values)
    np.testing.assert_allclose(total, expected, rtol=1e-10)


def radon_masked(floor, log_radon, real):
    """The edit the user needed before: the pooled reference, padded and masked."""
    mu_a = numpyro.sample("mu_a", dist.Normal(0.0, 10.0))
    sigma_a = numpyro.sample("sigma_a", dist.HalfNormal(5.0))
    b = numpyro.sample("b", dist.Normal(0.0, 10.0))
    sigma_y = numpyro.sample("sigma_y", dist.HalfNormal(5.0))
    with numpyro.plate("county", floor.shape[0], dim=-2):
        a = numpyro.sample("a", dist.Normal(mu_a, sigma_a))
        with numpyro.plate("home", floor.shape[1], dim=-1):
            with numpyro.handlers.mask(mask=real):
                numpyro.sample("y", dist.Normal(a + b * floor, sigma_y), obs=log_radon)


def test_ragged_nested_sfvi_equals_numpyro_svi():
    """SFVI on the unedited model over ragged silos equals centralized NumPyro SVI
    on the pooled data (padded, with the mask written in), iterate for iterate."""
    fed = nf.federate(radon, silos="county")
    silos = _radon_silos()
    data = nf.FederatedData.from_silos(silos)
    width = data.arrays["floor"].shape[-1]
    pooled = {
        k: np.concatenate(
            [np.pad(s[k], [(0, 0), (0, width - s[k].shape[1])]) for s in silos]
        )
        for k in ("floor", "log_radon")
    }
    pooled["real"] = np.arange(width) < np.array(HOMES)[:, None]
    ref_fed = nf.federate(radon_masked, silos="county")
    svi = nf.SFVI(
        fed,
        nf.AutoGlobalLocalNormal(fed),
        optax.adam(0.05),
        stl=False,
        reproducible=True,
    )
    state, ref = m.numpyro_svi_reference(
        ref_fed,
        nf.AutoGlobalLocalNormal(ref_fed),
        svi,
        data,
        20,
        optax.adam(0.05),
        pooled,
    )
    result = svi.run(None, 20, data, init_state=state, progress_bar=False)
    np.testing.assert_allclose(result.losses, ref.losses, rtol=1e-9)
    ours = svi.pooled_params(result.params, data)
    m.tree_allclose(ours, {k: ref.params[k] for k in ours}, rtol=1e-8, atol=1e-10)


@pytest.mark.parametrize("local_cov", ["diag", "full"])
def test_ragged_nested_guide_leaves_padded_coordinates_out(local_cov):
    """A silo's local factor over padded homes: with the mask, log q, log|J| and the
    real coordinates' draws equal those of the silo on its own (unpadded) data,
    whatever sits at the padded coordinates and in the factors that couple them."""
    fed = nf.federate(radon_latent, silos="county")
    silos = _radon_silos()
    data = nf.FederatedData.from_silos(silos)
    padded = nf.AutoGlobalLocalNormal(fed, local_cov=local_cov)
    padded.setup(data)
    rng = np.random.default_rng(5)
    eta_g = {"loc": jnp.asarray(rng.normal(size=3)), "scale": jnp.full(3, 0.5)}
    z_g = jnp.asarray(rng.normal(size=3))
    width = padded.local_dim
    for j in (0, 4):  # one home; three homes
        own = nf.AutoGlobalLocalNormal(fed, local_cov=local_cov)
        own.setup(nf.FederatedData.from_silos([silos[j]]))
        n = own.local_dim
        junk = rng.normal(size=(1, width, width)) * 3
        eta_pad = {
            "loc": jnp.asarray(rng.normal(size=(1, width))),
            "scale": jnp.asarray(rng.uniform(0.2, 2.0, size=(1, width))),
            "coupling": jnp.asarray(rng.normal(size=(1, width, 3))),
        }
        if local_cov == "full":
            eta_pad["tril"] = jnp.asarray(junk)
        eta_own = {
            k: v[:, :n, :n] if k == "tril" else v[:, :n] for k, v in eta_pad.items()
        }
        z_pad = jnp.asarray(rng.normal(size=(1, width)) * 4)
        eps_pad = jnp.asarray(rng.normal(size=(1, width)))
        mask = padded.local_mask({"home": HOMES[j]}, 1)
        assert mask.shape == (1, width) and int(mask.sum()) == n
        eta_r = padded.restrict_local(eta_pad, mask)
        np.testing.assert_allclose(
            padded.log_q_local(eta_g, eta_r, z_g, z_pad, mask),
            own.log_q_local(eta_g, eta_own, z_g, z_pad[:, :n]),
            rtol=1e-12,
        )
        np.testing.assert_allclose(
            padded.constrain_local(z_pad, mask)[1],
            own.constrain_local(z_pad[:, :n])[1],
            rtol=1e-12,
        )
        np.testing.assert_allclose(
            padded.sample_local(eta_g, eta_r, z_g, eps_pad)[:, :n],
            own.sample_local(eta_g, eta_own, z_g, eps_pad[:, :n]),
            rtol=1e-12,
        )


@pytest.mark.parametrize(
    "make",
    [
        lambda fed: nf.SFVI(
            fed, nf.AutoGlobalLocalNormal(fed, local_cov="full"), optax.adam(0.05)
        ),
        lambda fed: nf.SFVIAvg(
            fed, nf.AutoGlobalLocalNormal(fed), optax.adam(0.05), local_steps=3
        ),
        lambda fed: nf.PVI(fed, nf.AutoMeanField(fed), optax.adam(0.05), local_steps=3),
    ],
    ids=["sfvi", "sfvi_avg", "pvi"],
)
def test_ragged_nested_latents_run(make):
    """A latent per home, one county per silo: set-up and a few rounds, finite."""
    fed = nf.federate(radon_latent, silos="county")
    data = nf.FederatedData.from_silos(_radon_silos())
    result = make(fed).run(jax.random.key(0), 3, data, progress_bar=False)
    assert np.isfinite(np.asarray(result.losses)).all()


def test_a_deployed_silo_must_give_its_nested_plate_sizes():
    """A deployed silo loads its own data; on ragged nested plates the federation's
    layout carries each plate's real size, and a silo that leaves it out is told
    so (instead of its padded homes counting as data)."""
    from numpyro_fed.protocol import SiloData, silo_data_of
    from numpyro_fed.runtime.remote import RemoteSilo
    from numpyro_fed.util import take

    fed = nf.federate(radon, silos="county")
    data = nf.FederatedData.from_silos(_radon_silos())
    fit = nf.SFVI(fed, nf.AutoGlobalLocalNormal(fed), optax.adam(0.05))
    federation = fit.federation(data)
    nested = nf.partition.nested_sizes(fed, data, nf.partition.analyze(fed, data))
    own = take(silo_data_of(data, nested), 3)  # the 116-home county
    assert int(own.nested["home"]) == 116
    RemoteSilo(federation, own, jax.random.key(0))
    bare = SiloData(own.arrays, own.mask, own.unit_ids)
    with pytest.raises(ValueError, match=r"nested=\{plate: size\}"):
        RemoteSilo(federation, bare, jax.random.key(0))
