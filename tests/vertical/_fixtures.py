# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Vertically split models and data shared by the vertical tests."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer.util import log_density

import numpyro_fed as nf

PARTIES = ("a", "b", "c")
SIGMA, TAU, RHO = 0.7, 1.5, 0.4


def _party_contributions(xs, tau):
    """Each party's N(0, tau) coefficients and its contribution x_j @ beta_j."""
    etas = []
    for name, x in zip(PARTIES, xs, strict=True):
        with nf.vertical(name):
            beta = numpyro.sample(
                f"beta_{name}", dist.Normal(0.0, tau).expand([x.shape[1]]).to_event(1)
            )
            with numpyro.plate("rows", x.shape[0]):
                etas.append(nf.contribution(name, x @ beta))
    return etas


def gaussian_model(sigma=SIGMA, tau=TAU):
    """The spec's Gaussian fixture: J = 3 parties, known noise, N(0, tau) priors."""

    def model(x_a, x_b, x_c, y=None):
        etas = _party_contributions((x_a, x_b, x_c), tau)
        with numpyro.plate("rows", x_a.shape[0]):
            numpyro.sample("y", dist.Normal(sum(etas), sigma), obs=y)

    return model


def gaussian_model_latent_noise(tau=TAU):
    """The Gaussian fixture with server latents: an intercept and the noise scale."""

    def model(x_a, x_b, x_c, y=None):
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
        etas = _party_contributions((x_a, x_b, x_c), tau)
        with numpyro.plate("rows", x_a.shape[0]):
            numpyro.sample("y", dist.Normal(b + sum(etas), sigma), obs=y)

    return model


def gaussian_data(n=40, p=2, seed=0, labels="server", placeholder=float("nan")):
    rng = np.random.default_rng(seed)
    xs = {k: rng.normal(size=(n, p)) for k in PARTIES}
    beta = rng.normal(size=(3, p))
    y = sum(xs[k] @ beta[i] for i, k in enumerate(PARTIES)) + SIGMA * rng.normal(size=n)
    return nf.VerticalData(
        {k: {f"x_{k}": jnp.asarray(xs[k])} for k in PARTIES},
        {"y": jnp.asarray(y)},
        labels=labels,
        placeholder=placeholder,
    )


def rich_model(x_a, x_b, y=None):
    """Ragged parties (2 and 3 columns), a party hyperprior (constrained), a party
    numpyro.param, and server latents (intercept and noise scale)."""
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with nf.vertical("a"):
        s = numpyro.sample("s_a", dist.HalfNormal(1.0))
        beta_a = numpyro.sample(
            "beta_a", dist.Normal(0.0, s).expand([x_a.shape[1]]).to_event(1)
        )
        w = numpyro.param("w_a", 1.2)
        with numpyro.plate("rows", x_a.shape[0]):
            e_a = nf.contribution("a", w * (x_a @ beta_a))
    with nf.vertical("b"):
        beta_b = numpyro.sample(
            "beta_b", dist.Normal(0.0, 1.0).expand([x_b.shape[1]]).to_event(1)
        )
        with numpyro.plate("rows", x_b.shape[0]):
            e_b = nf.contribution("b", x_b @ beta_b)
    with numpyro.plate("rows", x_a.shape[0]):
        numpyro.sample("y", dist.Normal(b + e_a + e_b, sigma), obs=y)


def rich_data(n=12, seed=1, labels="server", placeholder=float("nan")):
    rng = np.random.default_rng(seed)
    x_a, x_b = rng.normal(size=(n, 2)), rng.normal(size=(n, 3))
    y = 0.3 + x_a @ np.array([1.0, -0.5]) + x_b @ np.array([0.5, 0.2, -1.0])
    y = y + 0.5 * rng.normal(size=n)
    return nf.VerticalData(
        {"a": {"x_a": jnp.asarray(x_a)}, "b": {"x_b": jnp.asarray(x_b)}},
        {"y": jnp.asarray(y)},
        labels=labels,
        placeholder=placeholder,
    )


def quadratic_form(model, data, names):
    """Exact Gaussian posterior of a model whose log joint is quadratic in the flat
    vector of ``names`` (from its Hessian and gradient at 0): ``(mean, precision)``."""
    arrays = data.pooled()
    tr = numpyro.handlers.trace(numpyro.handlers.seed(model, 0)).get_trace(**arrays)
    shapes = {k: jnp.shape(tr[k]["value"]) for k in names}
    sizes = [int(np.prod(s)) for s in shapes.values()]

    def f(w):
        values, start = {}, 0
        for k, size in zip(names, sizes, strict=True):
            values[k] = w[start : start + size].reshape(shapes[k])
            start += size
        return log_density(model, (), arrays, values)[0]

    w0 = jnp.zeros(sum(sizes))
    prec = -jax.jit(jax.hessian(f))(w0)
    return jnp.linalg.solve(prec, jax.jit(jax.grad(f))(w0)), prec


def quadratic_posterior(model, data, names):
    """:func:`quadratic_form` as ``(mean, covariance)``."""
    mean, prec = quadratic_form(model, data, names)
    return mean, jnp.linalg.inv(prec)


def conjugate(data, noise_var, tau=TAU):
    """Conjugate posterior of beta (stacked a, b, c) with noise variance
    ``noise_var``."""
    x = jnp.concatenate([data.arrays[f"x_{k}"] for k in PARTIES], axis=1)
    y = data.arrays["y"]
    prec = x.T @ x / noise_var + jnp.eye(x.shape[1]) / tau**2
    cov = jnp.linalg.inv(prec)
    return cov @ x.T @ y / noise_var, cov
