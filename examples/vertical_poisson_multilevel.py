# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Example: vertical federated multilevel Poisson regression (Hassan et al., §5.2)
==============================================================================

The paper's synthetic "SA2-like" design: N = 2000 areas; two parties (clients) hold
two standard-normal covariates each; a public population count
``pop_i ~ DiscreteUniform[250, 350]`` enters as the offset ``log pop_i``; each area
has one of 5 remoteness levels ``r_i`` (public, uniform). Cancer counts:

    y_i ~ Poisson(lambda_i),
    log lambda_i = b + u_{r_i} + log pop_i + sum_j x_ij^T beta_j^{r_i},
    beta_j^r ~ N(mu_j, sigma_j),  mu_j ~ N(0, 1),  sigma_j ~ HalfNormal(1),
    b ~ N(0, 1),  u_r ~ N(0, s_u),  s_u ~ HalfNormal(1).

Each party's hierarchy (its global effects ``mu_j``, spreads ``sigma_j`` and varying
slopes ``beta_j^r``, one per level and covariate) is private to it; the label-holding
server holds the intercept ``b`` and a random intercept ``u_r`` per level (the paper
has only ``b``; the level intercept is this example's addition). The generating
values are fixed below; the data are simulated with a fixed seed.

Fits: NUTS on the original model (the target); mean-field VI on the original model
(NumPyro ``SVI``, ``AutoNormal``); NUTS on the augmented model with the auxiliaries
integrated out (the likelihood reads only their sum, ``N(eta, J rho^2)``, so the
marginal is a Poisson-lognormal, computed by adaptive Gauss-Hermite quadrature): the
exact target of the augmented fits, which separates the AXDA bias from the
variational error; federated VI on the augmented-variable model (``nf.augment(model,
rho)``, Algorithm 1) with the mean-field and the amortized ``q(z)``, for rho in
{1, 2} (the paper's values; ``--rhos`` for others). The first table gives posterior
means and sds of the parties' global effects and spreads and of the server's
intercepts; the second summarizes every fit's error against both NUTS references.
Figure: ``vertical_poisson_multilevel.png`` in ``--output-dir`` (default
``examples/output/``): marginals of ``mu_1[0]`` and ``beta_1[0, 0]``, as in the
paper's Fig. 4.

Run: ``python examples/vertical_poisson_multilevel.py`` (9 minutes wall clock, 5 CPU
minutes, on a 2-core machine shared with other jobs), ``--quick`` for a smoke run
(400 areas, rho = 1, 200 rounds, short NUTS chains).
"""

import argparse
from pathlib import Path
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro import handlers
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
from numpyro.infer.initialization import init_to_median
from numpyro.infer.reparam import LocScaleReparam
import optax

import numpyro_fed as nf

jax.config.update("jax_enable_x64", True)

N, LEVELS = 2000, 5
# Generating values (not in the paper).
TRUTH = {
    "b": -1.0,
    "s_u": 0.3,
    "mu_1": np.array([0.3, -0.2]),
    "sigma_1": np.array([0.1, 0.15]),
    "mu_2": np.array([0.15, 0.25]),
    "sigma_2": np.array([0.2, 0.1]),
}
PARTIES = (("client1", "1"), ("client2", "2"))


def poisson_lognormal_logpmf(y, eta, s, nodes=20):
    """``log int Poisson(y | exp(t)) N(t; eta, s^2) dt`` by Gauss-Hermite quadrature
    centred at the integrand's mode (Newton steps) and scaled by its curvature. Any
    centre and scale give a valid quadrature, so they carry no gradient."""
    t = jnp.clip(jnp.log(y + 0.5), eta - 10 * s, eta + 10 * s)
    for _ in range(10):
        t = t + (y - jnp.exp(t) - (t - eta) / s**2) / (jnp.exp(t) + 1 / s**2)
    t = jax.lax.stop_gradient(t)
    scale = jax.lax.stop_gradient(1 / jnp.sqrt(jnp.exp(t) + 1 / s**2))
    x, w = np.polynomial.hermite.hermgauss(nodes)
    tk = t[:, None] + np.sqrt(2) * scale[:, None] * x
    log_g = (
        y[:, None] * tk
        - jnp.exp(tk)
        - jax.scipy.special.gammaln(y[:, None] + 1)
        - 0.5 * ((tk - eta[:, None]) / s) ** 2
        - jnp.log(s * np.sqrt(2 * np.pi))
    )
    return jax.nn.logsumexp(log_g + np.log(w) + x**2, -1) + jnp.log(np.sqrt(2) * scale)


def model(x_1, x_2, level, log_pop, y=None, noise_sd=0.0):
    """The multilevel Poisson model, marked by party (original semantics: NUTS on it
    is NUTS on the true model). With ``noise_sd = sqrt(J) rho`` it is the augmented
    model with its auxiliaries integrated out (the likelihood reads only their sum,
    ``N(eta, J rho^2)``): the exact target of the augmented VI fits."""
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    s_u = numpyro.sample("s_u", dist.HalfNormal(1.0))
    u = numpyro.sample("u", dist.Normal(0.0, s_u).expand([LEVELS]).to_event(1))
    eta = b + u[level] + log_pop
    for (party, k), x in zip(PARTIES, (x_1, x_2), strict=True):
        with nf.vertical(party):
            mu = numpyro.sample(
                f"mu_{k}", dist.Normal(0.0, 1.0).expand([2]).to_event(1)
            )
            sigma = numpyro.sample(
                f"sigma_{k}", dist.HalfNormal(1.0).expand([2]).to_event(1)
            )
            beta = numpyro.sample(
                f"beta_{k}", dist.Normal(mu, sigma).expand([LEVELS, 2]).to_event(2)
            )
            with numpyro.plate("areas", x.shape[0]):
                eta = eta + nf.contribution(party, jnp.sum(x * beta[level], -1))
    if noise_sd > 0:
        numpyro.factor("y", jnp.sum(poisson_lognormal_logpmf(y, eta, noise_sd)))
        return
    with numpyro.plate("areas", log_pop.shape[0]):
        numpyro.sample("y", dist.Poisson(jnp.exp(eta)), obs=y)


def simulate(seed=0, n=N):
    rng = np.random.default_rng(seed)
    x_1, x_2 = rng.normal(size=(n, 2)), rng.normal(size=(n, 2))
    pop = rng.integers(250, 351, size=n)
    level = rng.integers(0, LEVELS, size=n)
    u = TRUTH["s_u"] * rng.normal(size=LEVELS)
    beta_1 = TRUTH["mu_1"] + TRUTH["sigma_1"] * rng.normal(size=(LEVELS, 2))
    beta_2 = TRUTH["mu_2"] + TRUTH["sigma_2"] * rng.normal(size=(LEVELS, 2))
    eta = TRUTH["b"] + u[level] + np.log(pop)
    eta = eta + np.sum(x_1 * beta_1[level], 1) + np.sum(x_2 * beta_2[level], 1)
    y = rng.poisson(np.exp(eta)).astype(float)
    truth = dict(TRUTH, u=u, beta_1=beta_1, beta_2=beta_2)
    arrays = {
        "x_1": jnp.asarray(x_1),
        "x_2": jnp.asarray(x_2),
        "level": jnp.asarray(level),
        "log_pop": jnp.asarray(np.log(pop)),
        "y": jnp.asarray(y),
    }
    return arrays, truth


def vertical_data(arrays):
    return nf.VerticalData(
        {"client1": {"x_1": arrays["x_1"]}, "client2": {"x_2": arrays["x_2"]}},
        {"y": arrays["y"]},
        public={"level": arrays["level"], "log_pop": arrays["log_pop"]},
    )


def nuts(arrays, args, noise_sd=0.0):
    target = model
    if noise_sd > 0:
        # The auxiliaries' noise leaves the slopes weakly identified: the centred
        # hierarchy becomes a funnel for NUTS. Non-centring is the same model.
        target = handlers.reparam(
            model, config={f"beta_{k}": LocScaleReparam(0) for _, k in PARTIES}
        )
    mcmc = MCMC(
        NUTS(target),
        num_warmup=args.warmup,
        num_samples=args.samples,
        progress_bar=False,
    )
    mcmc.run(jax.random.key(0), **arrays, noise_sd=noise_sd)
    return {k: np.asarray(v) for k, v in mcmc.get_samples().items() if k in LATENTS}


def mfvi(arrays, args):
    guide = AutoNormal(model, init_loc_fn=init_to_median)
    svi = SVI(model, guide, optax.adam(0.01), Trace_ELBO())
    res = svi.run(jax.random.key(1), args.steps, progress_bar=False, **arrays)
    draws = guide.sample_posterior(jax.random.key(2), res.params, sample_shape=(4000,))
    return {k: np.asarray(v) for k, v in draws.items()}


def optimizer(steps, lr, z_lr):
    """Adam decayed tenfold; the mean-field auxiliaries get a larger step."""

    def schedule(rate):
        return optax.exponential_decay(rate, steps, 0.1)

    return optax.multi_transform(
        {"theta": optax.adam(schedule(lr)), "z": optax.adam(schedule(z_lr))},
        lambda raw: {k: "z" if k.startswith("z_") else "theta" for k in raw},
    )


def federated(arrays, rho, aux, args):
    party = optimizer(args.steps, args.lr, args.z_lr)
    # Each owner has its own optimizer. The server's intercepts start at 0, far from
    # log(y / pop): a larger step lets them get there before the parties' auxiliaries
    # absorb the offset (the counts make every gradient noisy).
    server = optax.adam(optax.exponential_decay(args.server_lr, args.steps, 0.1))
    vfl = nf.VerticalSFVI(
        nf.augment(model, rho),
        nf.VerticalFamily(aux=aux, theta_cov="full"),
        {"client1": party, "client2": party, "server": server},
    )
    # The progress-bar loop reuses the round compiled by init (bar on stderr).
    res = vfl.run(
        jax.random.key(3), args.steps, vertical_data(arrays), progress_bar=True
    )
    draws = vfl.sample_posterior(jax.random.key(4), res.params, num_samples=4000)
    return {k: np.asarray(v) for k, v in draws.items()}


LATENTS = ("b", "s_u", "u", "mu_1", "sigma_1", "beta_1", "mu_2", "sigma_2", "beta_2")
HEADLINE = [
    ("mu_1", (0,)),
    ("mu_1", (1,)),
    ("sigma_1", (0,)),
    ("sigma_1", (1,)),
    ("mu_2", (0,)),
    ("mu_2", (1,)),
    ("sigma_2", (0,)),
    ("sigma_2", (1,)),
    ("b", ()),
    ("b_u", (0,)),
    ("s_u", ()),
]
GROUPS = {
    "all": LATENTS,
    "beta": ("beta_1", "beta_2"),
    "hyper": ("mu_1", "sigma_1", "mu_2", "sigma_2"),
    "b_u": ("b_u",),
}


def with_level_intercepts(draws):
    # b and u_r are identified only through u's prior; b + u_r by the data.
    return dict(draws, b_u=draws["b"][:, None] + draws["u"])


def flat(draws, names):
    return np.concatenate([draws[k].reshape(draws[k].shape[0], -1) for k in names], 1)


def errors(fit, ref):
    out = {
        g: np.mean(np.abs(flat(fit, s).mean(0) - flat(ref, s).mean(0)))
        for g, s in GROUPS.items()
    }
    out["sd"] = np.median(flat(fit, LATENTS).std(0) / flat(ref, LATENTS).std(0))
    return out


def report(fits, truth, rhos):
    names = list(fits)
    truth = dict(truth, b_u=truth["b"] + truth["u"])
    print("\nPosterior mean (sd); federated VI rows fit the augmented model:")
    print("| parameter | true | " + " | ".join(names) + " |")
    print("|---" * (len(names) + 2) + "|")
    for site, index in HEADLINE:
        label = site + (f"[{index[0]}]" if index else "")
        cells = []
        for name in names:
            d = fits[name][site][(slice(None),) + index]
            cells.append(f"{d.mean():.3f} ({d.std():.3f})")
        true = np.asarray(truth[site])[index]
        print(f"| {label} | {true:.2f} | " + " | ".join(cells) + " |")
    print(
        "\nErrors: mean |E_q - E_ref| over the elements of all latents, the slopes "
        "beta (20), the parties' mu and sigma (8) and the level intercepts b + u_r "
        "(5); median sd_q / sd_ref over all latents. ref = NUTS on the original "
        "model, or on the augmented model with the same rho (its exact target)."
    )
    print(
        "| fit | ref | all | beta | mu, sigma | b + u_r | median sd ratio |\n"
        "|---|---|---|---|---|---|---|"
    )
    for name in names[1:]:
        refs = ["NUTS"]
        rho = name.split("rho=")[-1] if "rho=" in name else None
        if rho is not None and not name.startswith("NUTS"):
            refs.append(f"NUTS, augmented, rho={rho}")
        for ref in refs:
            e = errors(fits[name], fits[ref])
            tag = "original" if ref == "NUTS" else "augmented"
            print(
                f"| {name} | {tag} | {e['all']:.3f} | {e['beta']:.3f} | "
                f"{e['hyper']:.3f} | {e['b_u']:.3f} | {e['sd']:.2f} |"
            )


def plot(fits, truth, output_dir):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    for ax, (site, index, label) in zip(
        axes,
        (("mu_1", (0,), "mu_1[0]"), ("beta_1", (0, 0), "beta_1[level 0, 0]")),
        strict=True,
    ):
        for name, draws in fits.items():
            d = draws[site][(slice(None),) + index]
            grid = np.linspace(d.mean() - 4 * d.std(), d.mean() + 4 * d.std(), 300)
            h = 1.06 * d.std() * len(d) ** -0.2
            dens = np.exp(-0.5 * ((grid[:, None] - d) / h) ** 2).mean(1)
            ax.plot(grid, dens / (h * np.sqrt(2 * np.pi)), label=name)
        ax.axvline(np.asarray(truth[site])[index], color="tab:blue", lw=3, alpha=0.3)
        ax.set_title(label)
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "vertical_poisson_multilevel.png", dpi=110)
    print(f"\nFigure: {out}/vertical_poisson_multilevel.png")


def main():
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--rhos", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--z-lr", type=float, default=0.02)
    parser.add_argument("--server-lr", type=float, default=0.05)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--samples", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--areas", type=int, default=N)
    parser.add_argument("--output-dir", default=Path(__file__).parent / "output")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rhos, args.steps, args.warmup, args.samples = [1.0], 200, 100, 100
        args.areas = 400
    arrays, truth = simulate(args.seed, args.areas)
    print(
        f"N = {args.areas} areas, counts: mean {float(arrays['y'].mean()):.1f}, "
        f"range {int(arrays['y'].min())}-{int(arrays['y'].max())}"
    )
    fits = {}
    t0 = time.perf_counter()
    fits["NUTS"] = nuts(arrays, args)
    print(f"NUTS on the original model: {time.perf_counter() - t0:.0f} s")
    t0 = time.perf_counter()
    fits["MFVI, original"] = mfvi(arrays, args)
    print(f"MFVI on the original model: {time.perf_counter() - t0:.0f} s")
    for rho in args.rhos:
        t0 = time.perf_counter()
        fits[f"NUTS, augmented, rho={rho:g}"] = nuts(arrays, args, np.sqrt(2) * rho)
        print(
            f"NUTS on the augmented model (z integrated out), rho = {rho:g}: "
            f"{time.perf_counter() - t0:.0f} s"
        )
        for aux in ("meanfield", "amortized"):
            t0 = time.perf_counter()
            fits[f"{aux}, rho={rho:g}"] = federated(arrays, rho, aux, args)
            print(
                f"federated {aux} VI, rho = {rho:g}: {time.perf_counter() - t0:.0f} s",
                flush=True,
            )
    fits = {k: with_level_intercepts(v) for k, v in fits.items()}
    report(fits, truth, args.rhos)
    plot(fits, truth, args.output_dir)


if __name__ == "__main__":
    main()
