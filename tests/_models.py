# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Small models and data shared by the tests."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints


def hierarchical(y, t):
    """Groups (the silo plate, dim -2) with per-group intercept and slope, a learned
    noise scale theta, constrained globals and a nested observation plate."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 2.0).expand([2]).to_event(1))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    s = numpyro.param("s", 0.8, constraint=constraints.positive)
    with numpyro.plate("group", y.shape[0], dim=-2):
        b = numpyro.sample("b", dist.Normal(mu, tau).to_event(1))
        with numpyro.plate("obs", y.shape[1], dim=-1):
            numpyro.sample("y", dist.Normal(b[..., 0] + b[..., 1] * t, s), obs=y)


def hierarchical_data(num_groups=7, num_obs=3, seed=0):
    rng = np.random.default_rng(seed)
    t = rng.normal(size=(num_groups, num_obs))
    b = rng.normal(size=(num_groups, 2)) + np.array([1.0, -0.5])
    y = b[:, :1] + b[:, 1:] * t + 0.5 * rng.normal(size=(num_groups, num_obs))
    return {"y": jnp.asarray(y), "t": jnp.asarray(t)}


def logistic(X, y):
    """Flat logistic regression: rows are the silo plate ("data"), no local latents."""
    beta = numpyro.sample(
        "beta", dist.Normal(0.0, 3.0).expand([X.shape[-1]]).to_event(1)
    )
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ beta), obs=y)


def logistic_data(num_rows=40, num_features=3, seed=1):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(num_rows, num_features))
    y = (
        rng.uniform(size=num_rows) < 1 / (1 + np.exp(-X @ np.array([1.0, -1.0, 0.5])))
    ).astype(np.float64)
    return {"X": jnp.asarray(X), "y": jnp.asarray(y)}


def glmm(X, y):
    """The six-cities logistic GLMM (one row of 4 visits per child)."""
    beta = numpyro.sample(
        "beta", dist.Normal(0.0, 10.0).expand([X.shape[-1]]).to_event(1)
    )
    omega = numpyro.sample("omega", dist.Normal(0.0, 10.0))
    with numpyro.plate("child", X.shape[0], dim=-2):
        b = numpyro.sample("b", dist.Normal(0.0, jnp.exp(-omega)))
        with numpyro.plate("visit", X.shape[1], dim=-1):
            numpyro.sample("y", dist.Bernoulli(logits=X @ beta + b), obs=y)


def glmm_data(num_children=20, seed=2):
    rng = np.random.default_rng(seed)
    age = np.array([-2.0, -1.0, 0.0, 1.0])
    smoke = rng.integers(0, 2, size=num_children).astype(float)
    X = np.stack(
        [
            np.ones((num_children, 4)),
            np.repeat(smoke[:, None], 4, 1),
            np.tile(age, (num_children, 1)),
            smoke[:, None] * age,
        ],
        axis=-1,
    )
    b = 1.5 * rng.normal(size=(num_children, 1))
    logits = X @ np.array([-1.5, 0.3, -0.2, 0.1]) + b
    y = (rng.uniform(size=logits.shape) < 1 / (1 + np.exp(-logits))).astype(float)
    return {"X": jnp.asarray(X), "y": jnp.asarray(y)}


def normal_normal(y):
    """Conjugate hierarchy with known variances: the exact posterior is Gaussian."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 3.0))
    with numpyro.plate("group", y.shape[0], dim=-2):
        b = numpyro.sample("b", dist.Normal(mu, 1.0))
        with numpyro.plate("obs", y.shape[1], dim=-1):
            numpyro.sample("y", dist.Normal(b, 0.7), obs=y)


def normal_normal_posterior(y, prior_sd=3.0, tau=1.0, sigma=0.7):
    """Exact joint posterior (mean, cov) of (mu, b_1..b_G) for ``normal_normal``."""
    y = np.asarray(y)
    G, R = y.shape
    n = G + 1
    precision = np.zeros((n, n))
    precision[0, 0] = 1 / prior_sd**2 + G / tau**2
    for g in range(G):
        precision[0, g + 1] = precision[g + 1, 0] = -1 / tau**2
        precision[g + 1, g + 1] = 1 / tau**2 + R / sigma**2
    rhs = np.concatenate([[0.0], y.sum(1) / sigma**2])
    cov = np.linalg.inv(precision)
    return cov @ rhs, cov


def split_groups(num_units, num_silos):
    """Group ids of a contiguous-but-uneven split (silo j gets a varying share)."""
    return np.sort(np.arange(num_units) % num_silos)


def _as_numpy(x):
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):  # a key in a state
        x = jax.random.key_data(x)
    return np.asarray(x)


def tree_allclose(a, b, **kw):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(_as_numpy(x), _as_numpy(y), **kw)


def numpyro_svi_reference(fed, guide, svi, data, num_steps, optim, pooled=None):
    """Centralized NumPyro SVI started from a federated VI's initial parameters and
    key: ``(state, result)``, where ``state`` is the federated initial state whose key
    continues as the reference's does. ``pooled`` defaults to ``data.pooled()``."""
    from numpyro.infer import SVI, Trace_ELBO

    pooled = data.pooled() if pooled is None else pooled
    state = svi.init(jax.random.key(0), data)
    init = svi.pooled_params(svi.get_params(state), data)
    ref = SVI(fed, guide, optim, Trace_ELBO())
    ref_state = ref.init(jax.random.key(1), init_params=init, **pooled)
    result = ref.run(
        None, num_steps, progress_bar=False, init_state=ref_state, **pooled
    )
    return state._replace(rng_key=ref_state.rng_key), result
