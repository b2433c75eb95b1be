# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The families as NumPyro ``AutoGuide`` s: ``median``, ``quantiles``,
``sample_posterior``, ``get_posterior`` and ``Predictive``, on NumPyro's parameters
and on a federated fit's."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import biject_to, constraints
from numpyro.infer import Predictive
from numpyro.infer.autoguide import AutoGuide
import optax
import pytest
from scipy import stats

import numpyro_fed as nf
from numpyro_fed.families.structured import GLOBAL_PREFIX, LOCAL_PREFIX
from numpyro_fed.infer.pvi import PVIParams
from tests import _models as m
from tests.families.test_structured import _joint_moments, _random_params

UNITS = 7


@pytest.fixture(autouse=True)
def x64():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)


def amortized_features(arrays):
    return jnp.stack([arrays["y"].mean(-1), arrays["t"].mean(-1)], -1)


def make_guide(family):
    fed = nf.federate(m.hierarchical, silos="group")
    if family == "amortized":
        guide = nf.AutoAmortized(fed, features=amortized_features, hidden=(4,))
    elif family == "mean_field":
        guide = nf.AutoMeanField(fed)
    else:
        guide = nf.AutoGlobalLocalNormal(fed, local_cov=family)
    return fed, guide


def random_params(guide, key):
    """NumPyro-layout (pooled) parameters: random, so that every factor (tril,
    coupling, encoder) is away from its initial value."""
    data = m.hierarchical_data(num_groups=UNITS)
    guide.setup(nf.FederatedData.from_groups(np.zeros(UNITS, int), **data))
    glob_c, loc_c = guide.param_constraints()
    eta_g, eta_l = _random_params(guide, UNITS, key)
    if "silo_tril" in loc_c:
        n = UNITS * guide.local_dim
        eta_l["silo_tril"] = 0.5 * jax.random.normal(jax.random.fold_in(key, 9), (n, n))
    if "encoder" in glob_c:
        size = guide.encoder_size(2)
        eta_g["encoder"] = 0.5 * jax.random.normal(jax.random.fold_in(key, 8), (size,))
        eta_l["inputs"] = amortized_features(data)
    params = {GLOBAL_PREFIX + k: eta_g[k] for k in glob_c}
    params.update({LOCAL_PREFIX + k: eta_l[k] for k in loc_c})
    return params, data


def unconstrain(draws):
    """Site values -> the guide's unconstrained vector (mu, log tau, then b unit by
    unit), with any leading sample axes."""
    lead = draws["tau"].shape
    b = draws["b"].reshape(lead + (UNITS, 2))  # b is (..., units, 1, 2)
    return jnp.concatenate(
        [
            draws["mu"],
            jnp.log(draws["tau"])[..., None],
            b.reshape(lead + (UNITS * 2,)),
        ],
        -1,
    )


FAMILIES = ["full", "diag", "silo", "mean_field", "amortized"]


@pytest.mark.parametrize("family", FAMILIES)
def test_is_a_numpyro_autoguide(family):
    assert isinstance(make_guide(family)[1], AutoGuide)


@pytest.mark.parametrize("family", FAMILIES)
def test_median_is_the_constrained_location(family):
    """Exactly T(loc): mu = loc, tau = exp(loc), b = each unit's location (the
    encoder's output for the amortized family)."""
    _, guide = make_guide(family)
    params, _ = random_params(guide, jax.random.key(0))
    median = guide.median(params)
    loc_g = params[GLOBAL_PREFIX + "loc"]
    np.testing.assert_array_equal(median["mu"], loc_g[:2])
    positive = biject_to(constraints.positive)
    np.testing.assert_array_equal(median["tau"], positive(loc_g[2]))
    if family == "amortized":
        loc_l = guide.encode(
            params[GLOBAL_PREFIX + "encoder"], params[LOCAL_PREFIX + "inputs"]
        )[0]
    else:
        loc_l = params[LOCAL_PREFIX + "loc"]
    np.testing.assert_array_equal(median["b"], loc_l[:, None, :])
    assert set(median) == {"mu", "tau", "b"}


@pytest.mark.parametrize("family", FAMILIES)
def test_quantiles(family):
    """quantiles(0.5) is the median exactly; other levels are the constrained
    quantiles of each coordinate's Normal marginal, its variance the diagonal of
    the joint covariance (the coupling's share included)."""
    _, guide = make_guide(family)
    params, _ = random_params(guide, jax.random.key(1))
    levels = [0.05, 0.5, 0.9]
    q = guide.quantiles(params, levels)
    median = guide.median(params)
    for name in median:
        assert q[name].shape == (3,) + median[name].shape
        np.testing.assert_array_equal(q[name][1], median[name])
    post = guide.get_posterior(params)
    sd = np.sqrt(np.diag(post.covariance_matrix))
    expected = stats.norm.ppf(np.asarray(levels)[:, None], post.mean, sd)
    np.testing.assert_allclose(unconstrain(q), expected, rtol=1e-10, atol=1e-12)
    with pytest.raises(ValueError, match=r"quantiles must lie in \(0, 1\)"):
        guide.quantiles(params, [0.5, 1.0])


@pytest.mark.parametrize("family", ["full", "silo"])
def test_get_posterior_is_the_joint_gaussian(family):
    """The joint over (z_G, z_L1, ..., z_LU) with cross-covariances C_u Sigma_GG and
    C_u Sigma_GG C_v^T between units, against the closed form written out."""
    _, guide = make_guide(family)
    params, _ = random_params(guide, jax.random.key(2))
    eta_g = {k: params[GLOBAL_PREFIX + k] for k in ("loc", "scale", "tril")}
    eta_l = {k: params[LOCAL_PREFIX + k] for k in ("loc", "scale", "coupling")}
    if family == "full":
        eta_l["tril"] = params[LOCAL_PREFIX + "tril"]
        mean, cov = _joint_moments(eta_g, eta_l)
    else:  # one Cholesky factor over the silo's local coordinates
        eta_l["tril"] = jnp.zeros((UNITS, 2, 2))
        mean, cov = _joint_moments(eta_g, {**eta_l, "scale": jnp.zeros((UNITS, 2))})
        factor = eta_l["scale"].reshape(-1)[:, None] * (
            jnp.tril(params[LOCAL_PREFIX + "silo_tril"], -1) + jnp.eye(UNITS * 2)
        )
        cov = cov.at[3:, 3:].add(factor @ factor.T)
    post = guide.get_posterior(params)
    assert isinstance(post, dist.MultivariateNormal)
    np.testing.assert_allclose(post.mean, mean, rtol=1e-12)
    np.testing.assert_allclose(post.covariance_matrix, cov, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("family", ["full", "silo", "amortized"])
def test_sample_posterior_moments_match_get_posterior(family):
    """Draws' mean and covariance (global-local and unit-unit blocks included) are
    get_posterior's within 5 Monte Carlo standard errors of n draws: sd/sqrt(n) for
    a mean, sqrt((S_ii S_jj + S_ij^2) / n) for a covariance entry."""
    _, guide = make_guide(family)
    params, _ = random_params(guide, jax.random.key(3))
    n = 20_000
    draws = guide.sample_posterior(jax.random.key(4), params, sample_shape=(n,))
    assert draws["b"].shape == (n, UNITS, 1, 2) and draws["tau"].shape == (n,)
    z = unconstrain(draws)
    post = guide.get_posterior(params)
    cov = post.covariance_matrix
    sd = jnp.sqrt(jnp.diag(cov))
    assert jnp.all(jnp.abs(z.mean(0) - post.mean) < 5 * sd / jnp.sqrt(n))
    se = jnp.sqrt((jnp.outer(sd**2, sd**2) + cov**2) / n)
    assert jnp.all(jnp.abs(jnp.cov(z.T) - cov) < 5 * se)
    if family == "full":  # the coupling is there to be checked
        assert jnp.abs(cov[:3, 3:]).max() > 20 * se[:3, 3:].max()
    shaped = guide.sample_posterior(jax.random.key(4), params, sample_shape=(2, 3))
    assert shaped["b"].shape == (2, 3, UNITS, 1, 2)
    assert guide.sample_posterior(jax.random.key(4), params)["mu"].shape == (2,)


def fit_federated(family, groups=(0, 0, 0, 1, 1, 2, 2)):
    fed, guide = make_guide(family)
    data = nf.FederatedData.from_groups(np.asarray(groups), **m.hierarchical_data())
    svi = nf.SFVI(fed, guide, optax.adam(0.05))
    result = svi.run(jax.random.key(0), 20, data, progress_bar=False)
    return fed, guide, svi, result, data


@pytest.mark.parametrize("family", ["full", "amortized"])
def test_on_a_federated_fit(family):
    """guide.median(svi.get_params(state)): global sites as on the pooled params,
    local sites stacked by silo (gathered, the pooled median); the same layout for
    quantiles and draws; get_posterior asks for the pooled layout."""
    fed, guide, svi, result, data = fit_federated(family)
    stacked = svi.get_params(result.state)
    pooled = svi.pooled_params(stacked, data)
    median, reference = guide.median(stacked), guide.median(pooled)
    np.testing.assert_array_equal(median["mu"], reference["mu"])
    np.testing.assert_array_equal(median["tau"], reference["tau"])
    assert median["b"].shape == (3, data.padded_size, 1, 2)
    np.testing.assert_allclose(
        data.gather_units(median["b"]), reference["b"], rtol=1e-12
    )
    # PVI's parameters have the same layout.
    np.testing.assert_array_equal(guide.median(PVIParams(*stacked))["b"], median["b"])
    q = guide.quantiles(stacked, [0.1, 0.9])
    assert q["b"].shape == (2, 3, data.padded_size, 1, 2)
    np.testing.assert_allclose(
        data.gather_units(jnp.moveaxis(q["b"], 0, 2)),
        jnp.moveaxis(guide.quantiles(pooled, [0.1, 0.9])["b"], 0, 1),
        rtol=1e-12,
    )
    draws = guide.sample_posterior(jax.random.key(1), stacked, sample_shape=(5,))
    assert draws["b"].shape == (5, 3, data.padded_size, 1, 2)
    assert not np.allclose(draws["b"][:, 0, 0], draws["b"][:, 1, 0])  # own noise
    with pytest.raises(ValueError, match=r"svi.pooled_params\(result.params, data\)"):
        guide.get_posterior(stacked)
    # A deployed server's view: the global block, whose marginal it is.
    server = stacked._replace(eta_local={})
    assert set(guide.median(server)) == {"mu", "tau"}
    glob = guide.get_posterior(server)
    np.testing.assert_allclose(
        glob.covariance_matrix,
        guide.get_posterior(pooled).covariance_matrix[:3, :3],
        rtol=1e-12,
    )


@pytest.mark.parametrize("family", ["full", "amortized"])
def test_predictive_on_a_federated_model(family):
    """numpyro.infer.Predictive with the guide and a federated fit's parameters, on
    the pooled data: every site of the model, num_samples first."""
    fed, guide, svi, result, data = fit_federated(family)
    params = svi.pooled_params(result.params, data)
    sites = ["mu", "tau", "b", "y"]
    predictive = Predictive(fed, guide=guide, params=params, num_samples=6)
    out = predictive(jax.random.key(2), **data.pooled())
    assert set(out) == {"y"} and out["y"].shape == (6, UNITS, 3)
    out = Predictive(
        fed, guide=guide, params=params, num_samples=6, return_sites=sites
    )(jax.random.key(2), **data.pooled())
    shapes = {k: v.shape for k, v in out.items()}
    assert shapes == {
        "mu": (6, 2),
        "tau": (6,),
        "b": (6, UNITS, 1, 2),
        "y": (6, UNITS, 3),
    }
    assert np.all(out["tau"] > 0) and np.isfinite(out["y"]).all()
    # Its latent draws are the guide's: the same sites, in law, as sample_posterior.
    draws = guide.sample_posterior(jax.random.key(3), params, sample_shape=(6,))
    assert {k: v.shape for k, v in draws.items()} == {
        k: shapes[k] for k in ("mu", "tau", "b")
    }


def test_bad_params_name_what_to_pass():
    _, guide = make_guide("full")
    with pytest.raises(RuntimeError, match="not set up"):
        guide.median({})
    params, _ = random_params(guide, jax.random.key(5))
    del params[LOCAL_PREFIX + "coupling"]
    with pytest.raises(ValueError, match="_fed_local_coupling.*svi.get_params"):
        guide.median(params)
    with pytest.raises(TypeError, match="SFVIParams"):
        guide.median([1.0])
