# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Gaussian surrogates of the silo likelihoods (seed 001 spec T13): Laplace is exact on
conjugate Gaussian silos (with and without local latents), local SGLD moment matching
and VI recover them within Monte Carlo / optimization error; the natural-parameter
algebra and the validity checks."""

from functools import partial
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_fed as nf
from numpyro_fed.expfam import GaussianNat, from_moments, grad_log_density, to_moments
from numpyro_fed.surrogates import check_surrogates
from tests import _models as m


def blob_model(x):
    theta = numpyro.sample("theta", dist.Normal(0, 5**0.5).expand([2]).to_event(1))
    with nf.silo_plate("data", x.shape[0]):
        numpyro.sample("x", dist.Normal(theta, 1).to_event(1), obs=x)


@pytest.fixture(scope="module")
def blobs():
    rng = np.random.default_rng(0)
    xs = [
        c + 0.5 * rng.normal(size=(n, 2))
        for c, n in zip([-2, 0, 3], [50, 30, 40], strict=True)
    ]
    return xs, nf.FederatedData.from_silos([{"x": x} for x in xs])


@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_t13_laplace_is_exact_on_gaussian_silos(blobs, covariance):
    xs, data = blobs
    q = nf.fit_surrogates(blob_model, data, covariance=covariance)
    for s, x in enumerate(xs):
        n = len(x)
        expected = n * np.eye(2) if covariance == "full" else np.full(2, n)
        np.testing.assert_allclose(q.prec[s], expected, rtol=1e-8, atol=1e-8)
        np.testing.assert_allclose(q.h[s], x.sum(0), rtol=1e-8)  # N_s xbar_s
    q = nf.fit_surrogates(blob_model, data, prior_power=0.5)
    np.testing.assert_allclose(q.prec[0], (50 + 0.5 * 0.2) * np.eye(2), rtol=1e-8)
    # a concave log target: the start does not matter
    far = nf.fit_surrogates(
        blob_model, data, init_params={"theta": jnp.array([9.0, -9.0])}
    )
    exact = nf.fit_surrogates(blob_model, data)
    np.testing.assert_allclose(far.h, exact.h, rtol=1e-8)
    with pytest.raises(
        ValueError, match=r"init_params lacks the global site\(s\) \['theta'\]"
    ):
        nf.fit_surrogates(blob_model, data, init_params={"mu": jnp.zeros(2)})


def test_t13_laplace_with_local_latents_is_the_exact_marginal_likelihood():
    """normal_normal: ybar_g | mu ~ N(mu, tau^2 + sigma^2 / R) per group, so silo s's
    likelihood of mu has precision sum_g 1 / (1 + 0.49 / R), shift sum_g ybar_g * that."""
    rng = np.random.default_rng(1)
    y = rng.normal(size=(8, 4)) + 1.0
    groups = np.repeat([0, 1, 2], [2, 4, 2])
    data = nf.FederatedData.from_groups(groups, y=y)
    q = nf.fit_surrogates(nf.federate(m.normal_normal, silos="group"), data)
    w = 1 / (1.0 + 0.7**2 / 4)
    for s in range(3):
        ybar = y[groups == s].mean(1)
        np.testing.assert_allclose(q.prec[s], [[w * len(ybar)]], rtol=1e-8)
        np.testing.assert_allclose(q.h[s], [w * ybar.sum()], rtol=1e-8)


def test_t13_local_sgld_moment_matching_within_monte_carlo_error(blobs):
    xs, data = blobs
    n, h, draws = 50, 4e-3, 20000
    q = nf.fit_surrogates(
        blob_model,
        data,
        method="sgld",
        covariance="diag",
        step_size=h,
        num_warmup=500,
        num_samples=draws,
        rng_key=jax.random.key(3),
    )
    _assert_ula_moments(q, xs, h, draws, thinning=1)
    assert n == len(xs[0])


def _assert_ula_moments(q, xs, h, draws, thinning):
    """The surrogates' moments against ULA's stationary law on each silo's
    N(xbar, 1/lam) within 5 Monte Carlo standard errors; returns the effective
    sample sizes."""
    mean, var = jax.vmap(to_moments)(q)
    sizes = []
    for s, x in enumerate(xs):
        lam = len(x)
        # Langevin on a Gaussian is an AR(1) process; this is its lag between draws
        a = (1 - h * lam / 2) ** thinning
        stationary = 1 / (lam * (1 - h * lam / 4))  # ULA's known O(h) inflation
        ess = draws * (1 - a) / (1 + a)
        assert np.all(np.abs(mean[s] - x.mean(0)) < 5 * np.sqrt(stationary / ess))
        np.testing.assert_allclose(var[s], stationary, rtol=5 * np.sqrt(2 / ess))
        sizes.append(ess)
    return sizes


def test_thinned_sgld_moments_match_a_slowly_mixing_chain(blobs):
    """With h * lambda ~ 0.01 consecutive Langevin draws are nearly equal (lag-1
    autocorrelation 0.995), so 2,000 of them carry the information of ~5; 2,000 draws
    thinned by 200 carry that of hundreds and match the ULA target within that
    Monte Carlo error."""
    xs, data = blobs
    h, draws, thin = 2e-4, 2000, 200
    q = nf.fit_surrogates(
        blob_model,
        data,
        method="sgld",
        covariance="diag",
        step_size=h,
        num_warmup=5000,
        num_samples=draws,
        thinning=thin,
        rng_key=jax.random.key(4),
    )
    assert min(_assert_ula_moments(q, xs, h, draws, thinning=thin)) > 500
    with pytest.raises(ValueError, match="thinning must be an int >= 1"):
        nf.fit_surrogates(blob_model, data, "sgld", step_size=h, thinning=0)


@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_t13_vi_recovers_gaussian_silos(blobs, covariance):
    xs, data = blobs
    q = nf.fit_surrogates(
        blob_model,
        data,
        method="vi",
        covariance=covariance,
        num_steps=3000,
        learning_rate=1e-2,
    )
    mean, cov = jax.vmap(to_moments)(q)
    for s, x in enumerate(xs):
        sd = 1 / np.sqrt(len(x))  # the exact optimum is N(xbar_s, I / N_s)
        assert np.all(np.abs(mean[s] - x.mean(0)) < 0.05 * sd)
        expected = np.eye(2) if covariance == "full" else np.ones(2)
        np.testing.assert_allclose(cov[s] * len(x), expected, atol=0.1)


def test_natural_parameter_algebra():
    rng = np.random.default_rng(2)
    a = rng.normal(size=(3, 4, 4))
    cov = a @ a.transpose(0, 2, 1) + np.eye(4)
    mean = rng.normal(size=(3, 4))
    q = jax.vmap(from_moments)(jnp.asarray(mean), jnp.asarray(cov))
    back_mean, back_cov = jax.vmap(to_moments)(q)
    np.testing.assert_allclose(back_mean, mean, rtol=1e-9)
    np.testing.assert_allclose(back_cov, cov, rtol=1e-9)
    prod = jax.tree.map(lambda x: x.sum(0), q)  # natural parameters add
    np.testing.assert_allclose(prod.prec, np.linalg.inv(cov).sum(0), rtol=1e-10)
    theta = jnp.asarray(rng.normal(size=4))
    for s in range(3):
        log_q = lambda t, s=s: dist.MultivariateNormal(mean[s], cov[s]).log_prob(t)
        np.testing.assert_allclose(
            grad_log_density(q, theta)[s], jax.grad(log_q)(theta), rtol=1e-9
        )
    log_prod = lambda t: sum(
        dist.MultivariateNormal(mean[s], cov[s]).log_prob(t) for s in range(3)
    )
    np.testing.assert_allclose(
        grad_log_density(prod, theta), jax.grad(log_prod)(theta), rtol=1e-9
    )
    diag = jax.vmap(from_moments)(jnp.asarray(mean), jnp.full((3, 4), 2.0))
    np.testing.assert_allclose(grad_log_density(diag, theta), (mean - theta) / 2.0)


def test_invalid_surrogates_and_settings_raise_clear_errors(blobs):
    _, data = blobs
    ok = GaussianNat(h=jnp.zeros((2, 3)), prec=jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="silo 1 has a precision that is not positive"):
        check_surrogates(ok._replace(prec=ok.prec.at[1, 2].set(0.0)))
    full = GaussianNat(
        h=jnp.zeros((2, 2)),
        prec=jnp.stack([jnp.eye(2), jnp.diag(jnp.array([1.0, -1.0]))]),
    )
    with pytest.raises(ValueError, match="silo 1 has a precision that is not positive"):
        check_surrogates(full)
    asym = full._replace(prec=full.prec.at[0, 0, 1].set(0.5))
    with pytest.raises(ValueError, match="silo 0 has a non-symmetric precision"):
        check_surrogates(asym)
    with pytest.raises(ValueError, match="silo 0 has non-finite"):
        check_surrogates(ok._replace(h=ok.h.at[0, 0].set(jnp.nan)))
    with pytest.raises(ValueError, match="surrogates for 2 silos but the data hold 3"):
        check_surrogates(ok, num_silos=3)
    with pytest.raises(ValueError, match="need h"):
        check_surrogates(GaussianNat(h=jnp.zeros(3), prec=jnp.ones(3)))
    with pytest.raises(TypeError, match="GaussianNat"):
        check_surrogates((jnp.ones((2, 3)), jnp.zeros((2, 3))))
    with pytest.raises(ValueError, match="method must be one of"):
        nf.fit_surrogates(blob_model, data, method="ep")
    with pytest.raises(ValueError, match="covariance must be"):
        nf.fit_surrogates(blob_model, data, covariance="lowrank")
    with pytest.raises(ValueError, match="needs a positive step_size"):
        nf.fit_surrogates(blob_model, data, method="sgld")
    with pytest.raises(ValueError, match="prior_power"):
        nf.fit_surrogates(blob_model, data, prior_power=-1.0)


@pytest.mark.parametrize("method", ["laplace", "sgld"])
def test_silo_batches_fit_the_same_surrogates_as_one_vmap(blobs, method):
    _, data = blobs  # 3 silos: batches of 1, and of 2 with a remainder
    kwargs = dict(
        method=method, step_size=1e-3, num_warmup=50, num_samples=200, prior_power=0.1
    )
    together = nf.fit_surrogates(blob_model, data, **kwargs)
    for batch in (1, 2):
        batched = nf.fit_surrogates(blob_model, data, silo_batch_size=batch, **kwargs)
        for a, b in zip(batched, together, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-12)
    for bad, error in ((0, ValueError), (1.5, TypeError)):
        with pytest.raises(error, match="silo_batch_size must be an int >= 1"):
            nf.fit_surrogates(blob_model, data, silo_batch_size=bad)


def test_rank_deficient_local_likelihood_is_reported_and_prior_power_fixes_it():
    """A regression silo with one row cannot identify two coefficients: its Laplace
    precision is singular and the error names the silo; a share of the prior
    (prior_power) makes it proper."""

    def regression(X, y):
        beta = numpyro.sample("beta", dist.Normal(0.0, 2.0).expand([2]).to_event(1))
        with nf.silo_plate("data", X.shape[0]):
            numpyro.sample("y", dist.Normal(X @ beta, 1.0), obs=y)

    rng = np.random.default_rng(4)
    X, y = rng.normal(size=(6, 2)), rng.normal(size=6)
    data = nf.FederatedData.from_groups([0, 0, 0, 1, 0, 0], X=X, y=y)
    with pytest.raises(ValueError, match="silo 1 has a precision that is not positive"):
        nf.fit_surrogates(regression, data)
    q = nf.fit_surrogates(regression, data, prior_power=0.5)
    x = X[3]
    np.testing.assert_allclose(q.prec[1], np.outer(x, x) + 0.5 / 4 * np.eye(2))


@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_taylor_is_exact_on_gaussian_silos_from_any_point(blobs, covariance):
    _, data = blobs
    exact = nf.fit_surrogates(blob_model, data, covariance=covariance)
    for point in ([0.0, 0.0], [9.0, -4.0]):
        q = nf.fit_surrogates(
            blob_model,
            data,
            method="taylor",
            covariance=covariance,
            init_params={"theta": jnp.array(point)},
        )
        np.testing.assert_allclose(q.prec, exact.prec, rtol=1e-10)
        np.testing.assert_allclose(q.h, exact.h, rtol=1e-10, atol=1e-10)


def logistic_model(X, y):
    beta = numpyro.sample("beta", dist.Normal(0, 1).expand([2]).to_event(1))
    with nf.silo_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ beta), obs=y)


def student_model(x):
    mu = numpyro.sample("mu", dist.Normal(0, 10).expand([2]).to_event(1))
    with nf.silo_plate("data", x.shape[0]):
        numpyro.sample("x", dist.StudentT(2.0, mu, 1.0).to_event(1), obs=x)


@pytest.mark.parametrize(
    "covariance", [pytest.param("full", marks=pytest.mark.slow), "diag"]
)
def test_taylor_matches_the_silo_gradient_and_curvature_at_the_point(covariance):
    """At the shared point the surrogate's gradient is the silo's exactly; the
    precision is minus the Hessian (its diagonal), clipped where the curvature is
    negative (a Student-t silo far from its data)."""
    rng = np.random.default_rng(2)
    X = rng.normal(size=(60, 2))
    y = (rng.uniform(size=60) < jax.nn.sigmoid(X @ np.array([1.0, -2.0]))) * 1.0
    groups = np.repeat([0, 1, 2], 20)
    point = jnp.array([0.3, -0.7])
    for model, arrays in (
        (logistic_model, {"X": X, "y": y}),
        (student_model, {"x": X + 6.0}),
    ):
        data = nf.FederatedData.from_groups(groups, **arrays)
        name = "beta" if model is logistic_model else "mu"
        q = nf.fit_surrogates(
            model,
            data,
            method="taylor",
            covariance=covariance,
            init_params={name: point},
        )
        for s in range(3):
            rows = {k: v[groups == s] for k, v in arrays.items()}

            def silo(theta, rows=rows, model=model, name=name):
                with numpyro.handlers.block():
                    tr = numpyro.handlers.trace(
                        numpyro.handlers.substitute(model, data={name: theta})
                    ).get_trace(**rows)
                return sum(
                    site["fn"].log_prob(site["value"]).sum()
                    for site in tr.values()
                    if site["type"] == "sample" and site["is_observed"]
                )

            grad = jax.grad(silo)(point)
            np.testing.assert_allclose(
                grad_log_density(GaussianNat(q.h[s], q.prec[s]), point),
                grad,
                rtol=1e-10,
                atol=1e-12,
            )
            hess = -jax.hessian(silo)(point)
            eig = np.linalg.eigvalsh(hess)
            if model is logistic_model:  # concave: no clipping
                expected = hess if covariance == "full" else np.diag(hess)
                np.testing.assert_allclose(q.prec[s], expected, rtol=1e-10)
            else:  # 6 scales away a Student-t log-likelihood curves the wrong way
                assert eig.max() < 0
                prec = (
                    q.prec[s] if covariance == "diag" else np.linalg.eigvalsh(q.prec[s])
                )
                assert np.all(prec > 0)


def test_laplace_on_a_nonconvex_target_warns_and_stays_proper():
    """y ~ N(mu^2, 1) is not log-concave in mu. Given the steps, the Laplace fit
    reaches the mode, where the precision has a closed form (4 n ybar - 1 with
    half of the N(0, 1) prior); stopped early where the target curves down, it
    warns, names the silos, and keeps a proper, nearly flat surrogate."""

    def square(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with nf.silo_plate("data", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu**2, 1.0), obs=y)

    y = np.array([3.9, 4.0, 4.1, 1.0, 1.2])
    data = nf.FederatedData.from_groups([0, 0, 0, 1, 1], y=y)
    start = {"mu": 0.5}  # a Python float: the fit must stay in float64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = nf.fit_surrogates(square, data, prior_power=0.5, init_params=start)
    for s, ys in enumerate((y[:3], y[3:])):
        precision = 4 * ys.sum() - 1.0
        mode = np.sqrt(ys.mean() - 0.25 / len(ys))
        np.testing.assert_allclose(q.prec[s], [[precision]], rtol=1e-10)
        # either of the two modes +-mode (the first accepted step crosses zero)
        np.testing.assert_allclose(np.abs(q.h[s]), [precision * mode], rtol=1e-10)

    # One step from mu = 0.5: silo 0's Newton step goes uphill and is refused, and
    # its curvature there is 3 (6 mu^2 - 2 ybar) + 0.5 = -19: clipped to the floor.
    with pytest.warns(UserWarning) as record:
        q = nf.fit_surrogates(
            square, data, prior_power=0.5, init_params=start, num_steps=1
        )
    (message,) = [str(w.message) for w in record]
    assert "stopped before a mode on silo(s) [0, 1]" in message
    assert "num_steps=1" in message
    assert "On silo(s) [0] the fit ends where the target curves down" in message
    np.testing.assert_allclose(q.prec[0], [[19e-8]], rtol=1e-6)
    np.testing.assert_allclose(q.h[0], [19e-8 * 0.5], rtol=1e-6)
    assert q.prec[1, 0, 0] > 1.0  # silo 1 is convex there: unclipped


# ------------------------------------------------------------- issue 19 / 22
def _weak(y, likelihood_scale=1.0, prior_scale=1e8):
    """y ~ N(likelihood_scale * (a + b), 1): only a + b is identified; the prior
    N(0, prior_scale) adds a curvature of prior_scale**-2 per coordinate."""
    a = numpyro.sample("a", dist.Normal(0.0, prior_scale))
    b = numpyro.sample("b", dist.Normal(0.0, prior_scale))
    with nf.silo_plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(likelihood_scale * (a + b), 1.0), obs=y)


def _weak_data():
    y = np.array([0.3, -0.1, 0.4, 0.2, 0.9])
    return nf.FederatedData.from_groups([0, 0, 0, 1, 1], y=y)


def test_round_off_curvature_with_a_prior_share_is_clipped_as_documented():
    """With prior_power > 0 the target is proper, so an eigenvalue at round-off of
    the largest (here 1e-16 * w against 2 n, computed as zero or -1e-15) is raised
    to the floor, with a warning, as docs/fsgld.md says. Before: refused with
    "fit with prior_power > 0" although it was set. Without prior_power the same
    singular Hessian is a likelihood that does not identify a + b: refused."""
    data = _weak_data()
    with pytest.warns(UserWarning, match=r"On silo\(s\) \[0, 1\] the fit ends where"):
        q = nf.fit_surrogates(_weak, data, prior_power=0.5)
    for s, n in enumerate((3, 2)):
        eig = np.linalg.eigvalsh(q.prec[s])
        np.testing.assert_allclose(eig, [1e-8 * 2 * n, 2 * n], rtol=1e-6)
    with pytest.raises(ValueError, match="not positive definite .* prior_power > 0"):
        nf.fit_surrogates(_weak, data)


def test_a_numerically_zero_precision_is_refused_with_its_cause():
    """Before: a precision of 1e-300 (or a fit's 1e-18) was accepted: relative to
    the silo's own largest eigenvalue it is fine, but it is no Gaussian."""
    tiny = GaussianNat(h=jnp.zeros((2, 1)), prec=jnp.array([[1.0], [1e-300]]))
    with pytest.raises(ValueError, match="silo 1 has a precision that is numerically"):
        check_surrogates(tiny)
    with pytest.raises(ValueError, match="silo 0 has a precision that is numerically"):
        check_surrogates(
            GaussianNat(h=jnp.zeros((1, 2)), prec=1e-200 * jnp.eye(2)[None])
        )
    with pytest.raises(ValueError, match="silo 0 .*numerically zero"):
        nf.FSGLD(_weak, 1e-3, tiny._replace(prec=tiny.prec[::-1]))
    # a likelihood of 1e-9 * (a + b), with a prior share: the target is flat
    data = _weak_data()
    flat = lambda y: _weak(y, likelihood_scale=1e-9, prior_scale=1e9)  # noqa: E731
    with pytest.raises(ValueError, match="numerically zero") as error:
        nf.fit_surrogates(flat, data, prior_power=0.5)
    assert "prior_power=0.5" in str(error.value)
    assert "fit with prior_power > 0" not in str(error.value)

    def faint(y):  # one coordinate, seen through a factor 1e-9
        mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
        with nf.silo_plate("data", y.shape[0]):
            numpyro.sample("y", dist.Normal(1e-9 * mu, 1.0), obs=y)

    with pytest.raises(ValueError, match="numerically zero .* prior_power > 0"):
        nf.fit_surrogates(faint, data)


@pytest.fixture
def float32():
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", False)
    yield
    jax.config.update("jax_enable_x64", previous)


@pytest.mark.parametrize("covariance", ["full", "diag"])
def test_laplace_in_float32_reaches_the_mode_without_a_warning(float32, covariance):
    """The stopping tolerance follows the dtype (sqrt(eps)): before, float32 fits of
    conjugate silos warned "stopped before a mode" (their relative gradient stalls
    at round-off, up to 1e-5, above the float64 tolerance 1e-8)."""
    rng = np.random.default_rng(0)
    xs = [c + 0.5 * rng.normal(size=(50, 2)).astype(np.float32) for c in (-2, 0, 3)]
    data = nf.FederatedData.from_silos([{"x": x} for x in xs])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        q = nf.fit_surrogates(blob_model, data, covariance=covariance, prior_power=0.5)
    assert q.prec.dtype == jnp.float32
    for s, x in enumerate(xs):
        expected = 50 + 0.5 / 5
        prec = q.prec[s] if covariance == "diag" else np.diag(q.prec[s])
        np.testing.assert_allclose(prec, [expected, expected], rtol=1e-5)
        np.testing.assert_allclose(q.h[s], x.sum(0), rtol=1e-4, atol=1e-3)


class RecordingBar:
    """Stands in for tqdm: records its total, the steps it was told of and whether it
    was closed."""

    def __init__(self, bars, *, total, disable, **kwargs):
        self.total, self.disable, self.done, self.closed = total, disable, 0, False
        bars.append(self)

    def update(self, n):
        self.done += n

    def close(self):
        self.closed = True


@pytest.mark.parametrize(
    "method, kwargs, per_silo",
    [
        ("laplace", dict(num_steps=40), 40),
        ("laplace", dict(num_steps=40, silo_batch_size=2), 40),
        ("taylor", {}, 1),
        ("sgld", dict(step_size=1e-3, num_warmup=30, num_samples=70), 100),
        ("vi", dict(num_steps=60, silo_batch_size=2), 60),
    ],
    ids=["laplace", "laplace-batched", "taylor", "sgld", "vi-batched"],
)
def test_progress_bar_counts_every_silo_step_and_changes_nothing(
    blobs, monkeypatch, method, kwargs, per_silo
):
    """One bar over all silos' steps: it ends at silos x steps exactly (a batched
    while_loop runs finished silos' bodies too: they must not count), closes, and
    the surrogates are those fitted without it, bit for bit."""
    from numpyro_fed import surrogates

    _, data = blobs
    bars: list = []
    monkeypatch.setattr(surrogates, "tqdm", partial(RecordingBar, bars))
    q = nf.fit_surrogates(blob_model, data, method, **kwargs)
    ref = nf.fit_surrogates(blob_model, data, method, progress_bar=False, **kwargs)
    shown, hidden = bars
    assert not shown.disable and shown.total == data.num_silos * per_silo
    assert shown.done == shown.total and shown.closed
    assert hidden.disable and hidden.done == 0
    np.testing.assert_array_equal(q.h, ref.h)
    np.testing.assert_array_equal(q.prec, ref.prec)
