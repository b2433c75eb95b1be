# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""FSGLD / DSGLD against the seed 001 spec's exact results: T3 (the variance
decomposition of §2.5, by enumeration), T11 (misspecified surrogates, §2.6), T12
(Lemma 2's epsilon^2 against Assumption 1's gamma^2 on a grid) and the diagnostics of
:mod:`numpyro_fed.sgld_diagnostics`."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer import MCMC
from numpyro.infer.util import log_density
import pytest

import numpyro_fed as nf
from numpyro_fed.expfam import GaussianNat
from numpyro_fed.sgld_diagnostics import (
    epsilon_squared,
    gamma_squared,
    gradient_variance,
    mean_error_curves,
)
from tests import _models as m
from tests.algorithms.test_sgld import (
    LAMBDA0,
    bernoulli_model,
    blob_model,
    blobs,
    random_surrogates,
    silo,
    silo_drift,
)


def exact_surrogates(xs):
    """q_s = N(xbar_s, I / N_s): the Gaussian-mean model's exact silo likelihoods."""
    n = np.array([len(x) for x in xs], float)[:, None]
    means = np.stack([x.mean(0) for x in xs])
    return GaussianNat(
        h=jnp.asarray(n * means), prec=jnp.asarray(n * np.ones_like(means))
    )


def enumerate_drift(kernel, data, theta):
    """Mean, within-silo and between-silo trace of the drift by enumerating every silo
    and every ordered minibatch (all m-tuples with replacement, all m-permutations
    without), each equally likely given the silo; one vmapped call for all of them."""
    pot, cfg = kernel.potential(data), kernel.config(data)
    rows = []
    for s, n in enumerate(data.sizes):
        if cfg.replace:
            tuples = itertools.product(range(n), repeat=cfg.batch_size)
        else:
            tuples = itertools.permutations(range(n), cfg.batch_size)
        rows += [(s, t) for t in tuples]
    silos = np.array([r[0] for r in rows])
    idx = jnp.array([r[1] for r in rows])
    arrays = {k: v[silos] for k, v in data.arrays.items()}
    est = jax.vmap(silo_drift(pot, cfg), in_axes=(None, None, 0, 0, 0, 0))
    z = pot.unflatten(jnp.asarray(theta))
    psi = np.asarray(jax.jit(est)(z, {}, silos, arrays, data.mask[silos], idx)[0])
    means = np.stack([psi[silos == s].mean(0) for s in range(data.num_silos)])
    traces = np.array([psi[silos == s].var(0).sum() for s in range(data.num_silos)])
    f = np.asarray(cfg.silo_probs)
    mean = f @ means
    between = np.sum(f * np.sum((means - mean) ** 2, 1))
    return mean, float(f @ traces), float(between)


# ------------------------------------------------------------------ T3


@pytest.mark.parametrize("replace", [True, False], ids=["with", "without"])
def test_t3_variance_decomposition_by_enumeration(replace):
    """Any surrogates and any alpha: the enumerated mean is the pooled gradient, and
    the enumerated within/between traces equal the closed forms of §2.5."""
    d = m.logistic_data(num_rows=12)
    data = nf.FederatedData.from_groups(np.repeat([0, 1, 2], [3, 4, 5]), **d)
    fed = nf.federate(m.logistic, silos="data")
    f = [0.2, 0.3, 0.5]
    q = random_surrogates(np.random.default_rng(2), 3, 3, diagonal=False)
    beta = jnp.array([0.3, -0.2, 0.5])
    pooled = jax.grad(lambda b: log_density(m.logistic, (), d, {"beta": b})[0])(beta)
    betweens = []
    for alpha in (0.0, 0.7, 1.0) if replace else (1.0,):
        kernel = nf.FSGLD(
            fed, 1e-3, q, silo_probs=f, alpha=alpha, batch_size=2, replace=replace
        )
        mean, within, between = enumerate_drift(kernel, data, beta)
        exact = gradient_variance(kernel, data, beta)
        np.testing.assert_allclose(mean, pooled, rtol=1e-10)
        np.testing.assert_allclose(exact.mean, pooled, rtol=1e-10)
        np.testing.assert_allclose(exact.within, within, rtol=1e-10)
        np.testing.assert_allclose(exact.between, between, rtol=1e-10)
        np.testing.assert_allclose(exact.total, within + between, rtol=1e-10)
        betweens.append(between)
    # alpha moves the between-silo part only (the within part is alpha-free)
    assert len(set(np.round(betweens, 6))) == len(betweens)


def test_t3_exact_surrogates_with_alpha_one_remove_the_between_term():
    xs, data = blobs((4, 5, 6), np.array([[2.0, 0.0], [0.0, -3.0], [-1.0, 1.0]]), 0)
    q, f = exact_surrogates(xs), [0.2, 0.3, 0.5]
    theta = jnp.array([0.4, -0.7])
    fsgld = nf.FSGLD(blob_model, 1e-3, q, silo_probs=f, batch_size=2)
    dsgld = nf.DSGLD(blob_model, 1e-3, silo_probs=f, batch_size=2)
    mean_f, within_f, between_f = enumerate_drift(fsgld, data, theta)
    mean_d, within_d, between_d = enumerate_drift(dsgld, data, theta)
    np.testing.assert_allclose(mean_f, mean_d, rtol=1e-12)
    np.testing.assert_allclose(within_f, within_d, rtol=1e-12)
    assert between_f < 1e-20 * between_d and between_d > 100
    v = gradient_variance(fsgld, data, theta)
    assert float(v.between) < 1e-20 * between_d
    np.testing.assert_allclose(v.total, within_f, rtol=1e-12)
    # the within term with replacement: sum_s (N_s / f_s) tr Cov_hat(x_s) / m
    cov = sum(
        len(x) ** 2 / fs * x.var(0).sum() / 2 for x, fs in zip(xs, f, strict=True)
    )
    np.testing.assert_allclose(v.within, cov, rtol=1e-12)


def test_figure1_ratio_from_the_gradient_variance_diagnostic():
    """Figure 1's DSGLD/SGLD ratio (2.8441 without replacement) at several points:
    SGLD is DSGLD on the pooled data."""
    shards = [np.r_[np.ones(h), np.zeros(10 - h)] for h in (1, 5, 9)]
    split = nf.FederatedData.from_silos([{"y": y} for y in shards])
    pooled = nf.FederatedData.from_silos([{"y": np.concatenate(shards)}])
    kernel = nf.DSGLD(bernoulli_model, 1e-3, batch_size=5, replace=False)
    logits = jnp.array([[-1.0], [0.2], [2.0]])
    ratio = (
        gradient_variance(kernel, split, logits).total
        / gradient_variance(kernel, pooled, logits).total
    )
    np.testing.assert_allclose(ratio, 2.8441, atol=1e-4)
    one = gradient_variance(kernel, split, logits[1])
    assert one.total.shape == () and one.mean.shape == (1,)


# ----------------------------------------------------------------- T11


def posterior_mean(xs):
    return sum(x.sum(0) for x in xs) / (LAMBDA0 + sum(len(x) for x in xs))


def misspecified_targets(xs, f, q):
    """§2.6: silo s's expected drift is the gradient of N(nu_s, Pi_s^-1), here per
    coordinate (diagonal surrogates, isotropic likelihood)."""
    n = np.array([len(x) for x in xs], float)[:, None]
    xbar = np.stack([x.mean(0) for x in xs])
    p, mean_q = np.asarray(q.prec), np.asarray(q.h) / np.asarray(q.prec)
    f = np.asarray(f)[:, None]
    pi = LAMBDA0 + n / f + p.sum(0) - p / f
    nu = (n / f * xbar + (p * mean_q).sum(0) - p * mean_q / f) / pi
    return nu, pi


def switching_ula_moments(nu, pi, f, h, tau):
    """Exact stationary time-averaged mean and second moment (per coordinate) of ULA
    on N(nu_s, 1/pi_s) that switches to s ~ Cat(f) every tau steps."""
    f = np.asarray(f)[:, None]
    a = 1 - h * pi / 2
    ula = h / (1 - a**2)  # the stationary variance of ULA on one Gaussian
    at, a2t = a**tau, a ** (2 * tau)
    mu0 = np.sum(f * nu * (1 - at), 0) / (1 - np.sum(f * at, 0))  # at round starts
    m2 = np.sum(
        f
        * (
            nu**2
            + 2 * nu * at * (mu0 - nu)
            + a2t * (nu**2 - 2 * nu * mu0)
            + ula * (1 - a2t)
        ),
        0,
    ) / (1 - np.sum(f * a2t, 0))
    p = np.arange(1, tau + 1)[:, None, None]  # draws after each step of a round
    first = nu + a**p * (mu0 - nu)
    second = (
        nu**2
        + 2 * nu * a**p * (mu0 - nu)
        + a ** (2 * p) * (m2 - 2 * nu * mu0 + nu**2)
        + ula * (1 - a ** (2 * p))
    )
    return np.sum(f * first.mean(0), 0), np.sum(f * second.mean(0), 0)


@pytest.fixture(scope="module")
def misspecified():
    xs, data = blobs((20, 40, 60), np.array([[2.0, 0.0], [0.0, 2.0], [-2.0, -1.0]]), 3)
    rng = np.random.default_rng(4)
    n = np.array([[20.0], [40.0], [60.0]])
    means = np.stack([x.mean(0) for x in xs]) + rng.choice([-1.0, 1.0], size=(3, 2))
    precision = n * rng.uniform(0.6, 1.4, size=(3, 2))  # wrong mean and precision
    q = GaussianNat(h=jnp.asarray(precision * means), prec=jnp.asarray(precision))
    return xs, data, q, [0.25, 0.35, 0.4]


def test_t11_misspecified_surrogates_keep_the_expected_drift_exact(misspecified):
    """With tau = 1 and full batches the drift averaged over the silo choice is the
    pooled posterior gradient whatever q_s (T2 by enumeration of the silos)."""
    xs, data, q, f = misspecified
    # The paper's unbounded term: its silo targets lie beyond the default radius.
    kernel = nf.FSGLD(blob_model, 1e-3, q, silo_probs=f, conducive_radius=None)
    pot, cfg = kernel.potential(data), kernel.config(data)
    est = jax.jit(silo_drift(pot, cfg))
    pooled = {"x": jnp.asarray(np.concatenate(xs))}
    full = jax.grad(lambda t: log_density(blob_model, (), pooled, {"theta": t})[0])
    for theta in np.random.default_rng(5).normal(size=(3, 2)) * 2:
        z = {"theta": jnp.asarray(theta)}
        drift = sum(f[s] * est(z, {}, s, *silo(data, s))[0] for s in range(3))
        np.testing.assert_allclose(drift, full(z["theta"]), rtol=1e-10, atol=1e-10)
    # ... while each silo drifts to its own Gaussian N(nu_s, Pi_s^-1) of §2.6
    nu, pi = misspecified_targets(xs, f, q)
    for s in range(3):
        z = {"theta": jnp.asarray(nu[s])}
        np.testing.assert_allclose(est(z, {}, s, *silo(data, s))[0], 0.0, atol=1e-9)
        z = {"theta": jnp.asarray(nu[s] + 1.0)}
        np.testing.assert_allclose(est(z, {}, s, *silo(data, s))[0], -pi[s], rtol=1e-9)


def test_t11_misspecified_surrogates_target_the_mixture_of_silo_gaussians(
    misspecified,
):
    """Large tau, full batches: the chain's long-run mean and second moment match the
    exact switching-ULA values built from (nu_s, Pi_s), close to the mixture
    sum_s f_s N(nu_s, Pi_s^-1) and far from the posterior."""
    xs, data, q, f = misspecified
    nu, pi = misspecified_targets(xs, f, q)
    assert np.all(pi > 0)
    h, tau, rounds, chains = 3e-3, 40, 150, 16  # h * Pi_s in [0.3, 0.7]
    mean, second = switching_ula_moments(nu, pi, f, h, tau)
    mcmc = MCMC(
        # the paper's unbounded term, whose switching-ULA moments are exact
        nf.FSGLD(blob_model, h, q, tau=tau, silo_probs=f, conducive_radius=None),
        num_warmup=10 * tau,  # whole rounds, so draws start at a round boundary
        num_samples=rounds * tau,
        num_chains=chains,
        chain_method="vectorized",
        progress_bar=False,
    )
    mcmc.run(jax.random.key(0), data)
    draws = np.asarray(mcmc.get_samples(group_by_chain=True)["theta"])
    chain_means, chain_second = draws.mean(1), (draws**2).mean(1)
    se = chain_means.std(0, ddof=1) / np.sqrt(chains)
    se2 = chain_second.std(0, ddof=1) / np.sqrt(chains)
    assert np.all(np.abs(chain_means.mean(0) - mean) < 5 * se)
    assert np.all(np.abs(chain_second.mean(0) - second) < 5 * se2)
    # tau -> infinity: the mixture of the silo Gaussians (with ULA's variance)
    f_col = np.asarray(f)[:, None]
    ula = 1 / (pi * (1 - h * pi / 4))
    mix_mean, mix_second = np.sum(f_col * nu, 0), np.sum(f_col * (nu**2 + ula), 0)
    limit = switching_ula_moments(nu, pi, f, h, 100_000)
    np.testing.assert_allclose(limit, (mix_mean, mix_second), rtol=1e-3)
    np.testing.assert_allclose(mean, mix_mean, rtol=0.1)
    # the silo-choice averaging keeps the mixture's mean near the posterior's, but its
    # spread is the misspecification's signature: 0.29 and 0.094 against 1/120.2
    variance = chain_second.mean(0) - chain_means.mean(0) ** 2
    assert np.all(variance > 10 / (LAMBDA0 + 120))
    # exact surrogates: every silo's target is the posterior itself
    nu, pi = misspecified_targets(xs, f, exact_surrogates(xs))
    np.testing.assert_allclose(pi, LAMBDA0 + 120, rtol=1e-12)
    np.testing.assert_allclose(nu, np.broadcast_to(posterior_mean(xs), nu.shape))


# ----------------------------------------------------------------- T12


@pytest.fixture(scope="module")
def notebook_blobs():
    """§5.1 as in the authors' notebook: 10 blobs of 200, variance 0.125."""
    centers = np.random.default_rng(666).uniform(-6, 6, size=(10, 2))
    xs, data = blobs([200] * 10, centers, 666)
    axis = np.linspace(-7, 7, 21)  # includes the corners, where gamma^2 peaks
    grid = jnp.asarray(np.stack(np.meshgrid(axis, axis), -1).reshape(-1, 2))
    return xs, data, grid


def test_t12_epsilon_is_the_silo_spread_and_far_below_gamma(notebook_blobs):
    xs, data, grid = notebook_blobs
    eps = np.asarray(epsilon_squared(blob_model, data, exact_surrogates(xs), grid))
    spread = np.array([np.trace(np.cov(x.T, ddof=0)) for x in xs])
    assert eps.shape == (10, grid.shape[0])
    np.testing.assert_allclose(
        eps, np.repeat(spread[:, None], grid.shape[0], 1), rtol=1e-10
    )
    assert np.all((spread > 0.2) & (spread < 0.3))  # ~2 x 0.125
    gamma = np.asarray(gamma_squared(blob_model, data, grid))
    # mean_i ||x_i - theta||^2 = tr Cov_hat(x_s) + ||xbar_s - theta||^2
    xbar = np.stack([x.mean(0) for x in xs])
    dist2 = np.sum((xbar[:, None] - np.asarray(grid)[None]) ** 2, -1)
    np.testing.assert_allclose(gamma, spread[:, None] + dist2, rtol=1e-10)
    # measured on these blobs: eps^2 0.218-0.274, grid max of gamma^2 127-211, ratio
    # 530-917 (the same on a 100 x 100 grid)
    ratio = gamma.max(1) / eps.max(1)
    assert np.all(ratio > 300), ratio
    gamma_max = np.asarray(gamma_squared(blob_model, data, grid[:3], reduce="max"))
    brute = [
        [np.max(np.sum((x - t) ** 2, 1)) for t in np.asarray(grid[:3])] for x in xs
    ]
    np.testing.assert_allclose(gamma_max, brute, rtol=1e-10)


def test_epsilon_with_wrong_surrogates_adds_the_surrogate_gap(misspecified):
    """§2.4: eps_s^2(theta) = W_s(theta) + ||G_s - grad log q_s||^2 / N_s^2."""
    xs, data, q, _ = misspecified
    theta = np.array([[0.3, -0.4], [1.0, 2.0]])
    eps = np.asarray(epsilon_squared(blob_model, data, q, theta))
    p, shift = np.asarray(q.prec), np.asarray(q.h)
    for s, x in enumerate(xs):
        n = len(x)
        for g, t in enumerate(theta):
            gap = n * (x.mean(0) - t) - (shift[s] - p[s] * t)
            expected = x.var(0).sum() + np.sum(gap**2) / n**2
            np.testing.assert_allclose(eps[s, g], expected, rtol=1e-10)


# ------------------------------------------------- mean error, bad input


def test_mean_error_curves_on_exact_draws():
    """For iid N(mu, sigma^2 I_2) draws: T * E||muhat_T - mu||^2 = 2 sigma^2, and the
    notebook's distance levels off at E||theta - mu|| = sigma sqrt(pi / 2)."""
    rng = np.random.default_rng(0)
    sigma, mu, reps, t = 0.02, np.array([-1.6, 0.3]), 400, 500
    curves = [
        mean_error_curves(mu + sigma * rng.normal(size=(t, 2)), mu) for _ in range(reps)
    ]
    sq = np.array([c.squared_error[-1] for c in curves]) * t
    # T ||muhat - mu||^2 / sigma^2 is chi^2_2: mean 2, sd 2
    assert abs(sq.mean() / sigma**2 - 2) < 4 * 2 / np.sqrt(reps)
    dist = np.array([c.mean_distance[-1] for c in curves])
    # ||theta - mu|| / sigma is Rayleigh: sd sqrt(2 - pi / 2) ~ 0.655
    se = sigma * np.sqrt(2 - np.pi / 2) / np.sqrt(reps * t)
    assert abs(dist.mean() - sigma * np.sqrt(np.pi / 2)) < 5 * se
    assert curves[0].squared_error.shape == curves[0].mean_distance.shape == (t,)


def test_diagnostics_reject_bad_input():
    fed = nf.federate(m.normal_normal, silos="group")
    data = nf.FederatedData.from_groups([0, 0, 1], y=np.ones((3, 2)))
    with pytest.raises(NotImplementedError, match=r"local latent site\(s\) \['b'\]"):
        gamma_squared(fed, data, jnp.zeros((1, 1)))
    blob = nf.FederatedData.from_groups([0, 1], x=np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"thetas must be \(G, 2\)"):
        gamma_squared(blob_model, blob, jnp.zeros(2))
    with pytest.raises(ValueError, match="reduce must be"):
        gamma_squared(blob_model, blob, jnp.zeros((1, 2)), reduce="sum")
    with pytest.raises(ValueError, match="surrogates for 3 silos but the data hold 2"):
        epsilon_squared(
            blob_model,
            blob,
            exact_surrogates([np.zeros((1, 2))] * 3),
            jnp.zeros((1, 2)),
        )
    with pytest.raises(ValueError, match="draws must be"):
        mean_error_curves(np.zeros((5, 3)), np.zeros(2))
