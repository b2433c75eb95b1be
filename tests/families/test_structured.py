# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""T6: the structured Gaussian's density and moments (seed 000 spec §2.2)."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
import pytest

import numpyro_fed as nf
from numpyro_fed.families.gaussian import unit_tril
from tests import _models as m


def _random_params(guide, units, key):
    n_g, n_l = guide.global_dim, guide.local_dim
    k = jax.random.split(key, 8)
    eta_g = {
        "loc": jax.random.normal(k[0], (n_g,)),
        "scale": jnp.exp(0.3 * jax.random.normal(k[1], (n_g,))),
        "tril": 0.5 * jax.random.normal(k[2], (n_g, n_g)),
    }
    eta_l = {
        "loc": jax.random.normal(k[3], (units, n_l)),
        "scale": jnp.exp(0.3 * jax.random.normal(k[4], (units, n_l))),
        "coupling": 0.5 * jax.random.normal(k[5], (units, n_l, n_g)),
        "tril": 0.5 * jax.random.normal(k[6], (units, n_l, n_l)),
    }
    return eta_g, eta_l


def _joint_moments(eta_g, eta_l):
    """Implied joint mean and covariance of (z_G, z_L1, ..., z_LU) [spec §2.2]."""

    def cov(scale, tril):
        factor = scale[:, None] * unit_tril(tril)
        return factor @ factor.T

    sigma_gg = cov(eta_g["scale"], eta_g["tril"])
    units, n_l = eta_l["loc"].shape
    n_g = sigma_gg.shape[0]
    n = n_g + units * n_l
    mean = jnp.concatenate([eta_g["loc"], eta_l["loc"].reshape(-1)])
    big = jnp.zeros((n, n)).at[:n_g, :n_g].set(sigma_gg)
    for u in range(units):
        c = eta_l["coupling"][u]
        s = slice(n_g + u * n_l, n_g + (u + 1) * n_l)
        big = big.at[s, :n_g].set(c @ sigma_gg).at[:n_g, s].set(sigma_gg @ c.T)
        for v in range(units):
            t = slice(n_g + v * n_l, n_g + (v + 1) * n_l)
            block = c @ sigma_gg @ eta_l["coupling"][v].T
            if u == v:
                block = block + cov(eta_l["scale"][u], eta_l["tril"][u])
            big = big.at[s, t].set(block)
    return mean, big


@pytest.fixture
def guide():
    fed = nf.federate(m.hierarchical, silos="group")
    data = nf.FederatedData.from_groups(np.zeros(7, int), **m.hierarchical_data())
    g = nf.AutoGlobalLocalNormal(fed, local_cov="full")
    g.setup(data)
    return g


def test_log_density_is_joint_gaussian(guide):
    """log q(z_G) + sum_u log q(z_Lu | z_G) equals the joint MVN log density."""
    eta_g, eta_l = _random_params(guide, 4, jax.random.key(0))
    mean, cov = _joint_moments(eta_g, eta_l)
    key = jax.random.key(1)
    z_g = guide.sample_global(eta_g, guide.global_noise(key))
    z_l = guide.sample_local(eta_g, eta_l, z_g, guide.local_noise(key, jnp.arange(4)))
    ours = (
        guide.log_q_global(eta_g, z_g) + guide.log_q_local(eta_g, eta_l, z_g, z_l).sum()
    )
    z = jnp.concatenate([z_g, z_l.reshape(-1)])
    np.testing.assert_allclose(
        ours, dist.MultivariateNormal(mean, cov).log_prob(z), rtol=1e-10
    )


def test_monte_carlo_moments(guide):
    """Sample moments match the implied mean, cross-covariance Sigma_GG C^T and local
    covariance C Sigma_GG C^T + Sigma_LL, including across units (within 5 MC sd)."""
    eta_g, eta_l = _random_params(guide, 2, jax.random.key(2))
    mean, cov = _joint_moments(eta_g, eta_l)

    def draw(key):
        z_g = guide.sample_global(eta_g, guide.global_noise(key))
        z_l = guide.sample_local(
            eta_g, eta_l, z_g, guide.local_noise(key, jnp.arange(2))
        )
        return jnp.concatenate([z_g, z_l.reshape(-1)])

    n = 200_000
    z = jax.vmap(draw)(jax.random.split(jax.random.key(3), n))
    sd = jnp.sqrt(jnp.diag(cov))
    assert jnp.all(jnp.abs(z.mean(0) - mean) < 5 * sd / jnp.sqrt(n))
    emp = jnp.cov(z.T)
    # sd of a sample covariance entry: sqrt((S_ii S_jj + S_ij^2) / n)
    se = jnp.sqrt((jnp.outer(sd**2, sd**2) + cov**2) / n)
    assert jnp.all(jnp.abs(emp - cov) < 5 * se)


def test_numpyro_guide_log_density(guide):
    """As a NumPyro guide, the auxiliary site carries log q in constrained space:
    the Gaussian density minus the log-Jacobian of the support transforms."""
    from numpyro import handlers

    data = m.hierarchical_data()
    tr = handlers.trace(handlers.seed(guide, 0)).get_trace(**data)
    eta_g = {
        k[len("_fed_global_") :]: tr[k]["value"]
        for k in tr
        if k.startswith("_fed_global_")
    }
    assert set(eta_g) == {"loc", "scale", "tril"}
    tau = tr["tau"]["value"]
    assert tau > 0 and tr["b"]["value"].shape == (7, 1, 2)
    log_q = tr["_fed_latent"]["fn"].log_prob(tr["_fed_latent"]["value"])
    assert jnp.isfinite(log_q)


def test_mean_field_has_no_coupling():
    fed = nf.federate(m.hierarchical, silos="group")
    data = nf.FederatedData.from_groups(np.zeros(7, int), **m.hierarchical_data())
    g = nf.AutoMeanField(fed)
    g.setup(data)
    glob, loc = g.param_constraints()
    assert set(glob) == {"loc", "scale"} and set(loc) == {"loc", "scale"}
    assert (g.global_dim, g.local_dim) == (3, 2)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(global_cov="dense"), "global_cov"),
        (dict(local_cov="block"), "local_cov"),
        (dict(init_scale=0.0), "init_scale"),
    ],
)
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        nf.AutoGlobalLocalNormal(nf.federate(m.hierarchical, silos="group"), **kwargs)


def test_silo_wide_log_density_is_joint_gaussian():
    """local_cov="silo": the per-unit chain-rule terms sum to the joint MVN density,
    and the leading units' terms alone give their marginal (what padding relies on)."""
    fed = nf.federate(m.hierarchical, silos="group")
    data = nf.FederatedData.from_groups(np.zeros(7, int), **m.hierarchical_data())
    guide = nf.AutoGlobalLocalNormal(fed, local_cov="silo")
    guide.setup(data)
    units, n_g, n_l = 3, guide.global_dim, guide.local_dim
    eta_g, eta_l = _random_params(guide, units, jax.random.key(4))
    eta_l = {k: v for k, v in eta_l.items() if k != "tril"}
    eta_l["silo_tril"] = 0.5 * jax.random.normal(jax.random.key(5), (units * n_l,) * 2)
    key = jax.random.key(6)
    z_g = guide.sample_global(eta_g, guide.global_noise(key))
    z_l = guide.sample_local(
        eta_g, eta_l, z_g, guide.local_noise(key, jnp.arange(units))
    )
    terms = guide.log_q_local(eta_g, eta_l, z_g, z_l)

    factor = eta_l["scale"].reshape(-1)[:, None] * unit_tril(eta_l["silo_tril"])
    coupling = eta_l["coupling"].reshape(units * n_l, n_g)
    mean = eta_l["loc"].reshape(-1) + coupling @ (z_g - eta_g["loc"])
    cov = factor @ factor.T
    expected = dist.MultivariateNormal(mean, cov).log_prob(z_l.reshape(-1))
    np.testing.assert_allclose(terms.sum(), expected, rtol=1e-10)
    lead = n_l * 2  # the first two units' marginal
    marginal = dist.MultivariateNormal(mean[:lead], cov[:lead, :lead])
    np.testing.assert_allclose(
        terms[:2].sum(), marginal.log_prob(z_l.reshape(-1)[:lead]), rtol=1e-10
    )


def test_old_name_warns_and_returns_the_renamed_guide():
    with pytest.warns(FutureWarning, match="AutoGlobalLocalNormal"):
        old = nf.AutoStructured
    assert old is nf.AutoGlobalLocalNormal
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = nf.no_such_name
