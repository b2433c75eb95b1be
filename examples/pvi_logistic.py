# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Example: partitioned VI for Bayesian logistic regression (breast cancer, 10 silos)
=================================================================================

Bayesian logistic regression on scikit-learn's Wisconsin breast-cancer data (569
rows, 30 features, standardized with the training rows' statistics, plus an
intercept), prior :math:`w \\sim N(0, I)`. The 80% training split is divided into 10
silos, IID (``nf.data.split_iid``) and label-skewed (``nf.data.split_label_skew``: 90% of each
silo is one class). Compared:

- PVI with the sequential, synchronous (damping :math:`\\rho = 1/J`) and
  asynchronous (staleness up to 2 updates) schedules, mean-field Gaussian q, Adam
  local solves warm-started from the received q;
- global VI: NumPyro ``SVI`` with the same mean-field family on the pooled data,
  run to convergence (``--gvi-steps``): the optimum PVI's fixed point should equal
  (the paper's Property 3), so the table also reports each PVI run's distance to it;
- NUTS on the pooled data (the reference).

The script prints ``nf.compare`` summaries against NUTS, the spec's T9 sanity checks
(means within 0.2 NUTS posterior sd, mean-field sds at most 1.05 NUTS sds), and
saves test accuracy and test log-likelihood per communication round to
``pvi_logistic.png`` in ``--output-dir`` (default ``examples/output/``). One round
is one update from every silo
(``J`` uplink messages) for every schedule.

Because the local solves are stochastic (Monte Carlo ELBO, Adam), the final q of a
run jitters around PVI's fixed point; the reported posterior is the average of the
natural parameters of the last ``--average`` rounds' q (Polyak averaging, applied
alike to every schedule).

Run: ``python examples/pvi_logistic.py`` (a few minutes on 2 CPU cores); ``--quick``
for a smoke run (4 rounds of 10 local steps, a short NUTS chain).
"""

import argparse
from pathlib import Path
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS, SVI, Trace_ELBO
import optax

import numpyro_fed as nf
from numpyro_fed.expfam import GaussianNat, from_moments, to_moments

numpyro.enable_x64()


def logistic(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[-1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def load(seed=0):
    """Standardized breast-cancer features with an intercept column; 80/20 split."""
    from sklearn.datasets import load_breast_cancer
    from sklearn.model_selection import train_test_split

    X, y = load_breast_cancer(return_X_y=True)
    X_tr, X_te, y_tr, y_te = train_test_split(
        X, y, test_size=0.2, random_state=seed, stratify=y
    )
    mu, sd = X_tr.mean(0), X_tr.std(0)

    def prep(x):
        x = (x - mu) / sd
        return np.concatenate([np.ones((len(x), 1)), x], 1)

    return prep(X_tr), y_tr.astype(float), prep(X_te), y_te.astype(float)


def predictive(mean, var, X, y, key, num_samples=400):
    """Test accuracy and mean test log predictive density of N(mean, diag(var))."""
    w = mean + jnp.sqrt(var) * jax.random.normal(key, (num_samples,) + mean.shape)
    logits = X @ w.T  # (n, S)
    log_p = jnp.where(
        y[:, None] == 1, -jnp.logaddexp(0, -logits), -jnp.logaddexp(0, logits)
    )
    lpd = jax.scipy.special.logsumexp(log_p, 1) - jnp.log(num_samples)
    prob = jnp.mean(jax.nn.sigmoid(logits), 1)
    return float(jnp.mean((prob > 0.5) == (y == 1))), float(jnp.mean(lpd))


def averaged(history_q, last):
    """Mean of the last ``last`` rounds' natural parameters (a valid Gaussian: the
    natural-parameter space is convex)."""
    q = GaussianNat(*(jnp.mean(x[-last:], 0) for x in history_q))
    return to_moments(q)


def draws_of(mean, var, key, num_samples=4000):
    return {
        "w": np.asarray(
            mean + jnp.sqrt(var) * jax.random.normal(key, (num_samples,) + mean.shape)
        )
    }


def run_pvi(args, schedule, data, X_te, y_te):
    fed = nf.federate(logistic, silos="data")
    pvi = nf.PVI(
        fed,
        nf.AutoMeanField(fed),
        optax.adam(args.lr),
        local_steps=args.local_steps,
        num_particles=args.num_particles,
        schedule=schedule,
    )
    start = time.perf_counter()
    result = pvi.run(jax.random.key(args.seed), args.rounds, data, progress_bar=False)
    seconds = time.perf_counter() - start
    qs = result.history["q"]
    curve = []
    for r in range(args.rounds):
        mean, var = to_moments(GaussianNat(qs.h[r], qs.prec[r]))
        curve.append(predictive(mean, var, X_te, y_te, jax.random.key(r)))
    mean, var = averaged(qs, args.average)
    return (
        mean,
        var,
        np.asarray(curve),
        seconds,
        float(jnp.min(result.history["scale"])),
    )


def run_global_vi(args, data):
    """NumPyro SVI on the pooled data with the same family and optimizer: the optimum
    PVI's fixed point should reach (Property 3), so it gets ``--gvi-steps`` steps
    (many more than a silo's share of a PVI run), and its last quarter of iterates is
    averaged in natural parameters, as PVI's last rounds are."""
    fed = nf.federate(logistic, silos="data")
    svi = SVI(
        fed,
        nf.AutoMeanField(fed),
        optax.adam(args.lr),
        Trace_ELBO(num_particles=args.num_particles),
    )
    pooled = data.pooled()
    state = svi.init(jax.random.key(args.seed), **pooled)

    def step(state, _):
        state, loss = svi.update(state, **pooled)
        params = svi.get_params(state)
        return state, (params["_fed_global_loc"], params["_fed_global_scale"])

    scan = jax.jit(lambda s: jax.lax.scan(step, s, length=args.gvi_steps))
    _, (locs, scales) = scan(state)
    return averaged(from_moments(locs, scales**2), args.gvi_steps // 4)


def main(args):
    X_tr, y_tr, X_te, y_te = load(args.seed)
    X_te, y_te = jnp.asarray(X_te), jnp.asarray(y_te)
    print(
        f"breast cancer: {len(y_tr)} train / {len(y_te)} test rows, "
        f"{X_tr.shape[1]} coefficients (intercept + 30 features), prior N(0, 1); "
        f"J = {args.num_silos} silos, {args.rounds} rounds x {args.local_steps} Adam "
        f"steps (lr {args.lr}, {args.num_particles} particles)"
    )
    mcmc = MCMC(
        NUTS(logistic),
        num_warmup=args.nuts_warmup,
        num_samples=args.nuts_samples,
        num_chains=args.nuts_chains,
        chain_method="sequential",
        progress_bar=False,
    )
    start = time.perf_counter()
    mcmc.run(jax.random.key(0), jnp.asarray(X_tr), jnp.asarray(y_tr))
    nuts = {"w": np.asarray(mcmc.get_samples()["w"])}
    print(
        f"NUTS: {args.nuts_chains} x {args.nuts_samples} draws ({time.perf_counter() - start:.0f} s)"
    )
    nuts_mean, nuts_var = nuts["w"].mean(0), nuts["w"].var(0)
    perf = {
        "NUTS": predictive(
            jnp.asarray(nuts_mean), jnp.asarray(nuts_var), X_te, y_te, jax.random.key(0)
        )
    }
    # NUTS's own predictive uses its draws, not a Gaussian summary.
    logits = X_te @ jnp.asarray(nuts["w"]).T
    log_p = jnp.where(
        y_te[:, None] == 1, -jnp.logaddexp(0, -logits), -jnp.logaddexp(0, logits)
    )
    perf["NUTS"] = (
        float(jnp.mean((jnp.mean(jax.nn.sigmoid(logits), 1) > 0.5) == (y_te == 1))),
        float(
            jnp.mean(jax.scipy.special.logsumexp(log_p, 1) - jnp.log(logits.shape[1]))
        ),
    )

    splits = {
        "IID": nf.data.split_iid(len(y_tr), args.num_silos, seed=args.seed),
        "label-skew": nf.data.split_label_skew(y_tr, args.num_silos, 0.9, seed=args.seed),
    }
    curves, rows, tables = {}, [], {}
    for split, groups in splits.items():
        data = nf.FederatedData.from_groups(groups, X=X_tr, y=y_tr)
        fits = {}
        for schedule in ("sequential", "synchronous", "asynchronous"):
            mean, var, curve, secs, scale = run_pvi(args, schedule, data, X_te, y_te)
            fits[f"PVI-{schedule[:4]}"] = (mean, var, secs)
            curves[(split, schedule)] = curve
            if scale < 1:
                print(
                    f"  ({split}, {schedule}: the server shrank an update to {scale:.3g})"
                )
        start = time.perf_counter()
        mean, var = run_global_vi(args, data)
        mean.block_until_ready()
        fits["global VI"] = (mean, var, time.perf_counter() - start)
        gvi_mean, gvi_var, _ = fits["global VI"]
        for name, (mean, var, secs) in fits.items():
            table = nf.compare(
                draws_of(mean, var, jax.random.key(1)), nuts, labels=(name, "nuts")
            )
            tables[(split, name)] = table
            # T9 with the exact moments of q (draws only add Monte Carlo noise).
            z = np.abs(np.asarray(mean) - nuts_mean) / np.sqrt(nuts_var)
            ratio = np.sqrt(np.asarray(var) / nuts_var)
            # Property 3: PVI's fixed point is global VI's optimum in the same family.
            to_gvi = np.abs(np.asarray(mean - gvi_mean)) / np.sqrt(nuts_var)
            to_gvi_sd = np.abs(np.log(np.asarray(var / gvi_var))) / 2
            acc, lpd = predictive(mean, var, X_te, y_te, jax.random.key(2))
            rows.append(
                (split, name, acc, lpd, z.max(), ratio.min(), ratio.max(), secs)
                + (to_gvi.max(), to_gvi_sd.max())
            )
        if split == "IID":
            print(
                f"\nnf.compare, PVI-synchronous ({split}) vs NUTS, first 8 coefficients:"
            )
            print(nf.format_compare(tables[(split, "PVI-sync")].iloc[:8]))

    print("\nTest metrics and T9 checks against NUTS (q's exact moments)")
    print(
        f"{'split':>10} {'method':>10} {'acc':>6} {'test lpd':>9} {'max|dmean|/sd':>14} "
        f"{'min sd ratio':>13} {'max sd ratio':>13} {'T9 m/sd':>7} {'time s':>7} "
        f"{'vs GVI dmean/sd':>16} {'vs GVI |dlog sd|':>17}"
    )
    acc, lpd = perf["NUTS"]
    print(f"{'pooled':>10} {'NUTS':>10} {acc:6.3f} {lpd:9.4f}")
    for split, name, acc, lpd, z, rmin, rmax, secs, gz, gs in rows:
        ok = ("ok" if z < 0.2 else "no") + "/" + ("ok" if rmax <= 1.05 else "no")
        print(
            f"{split:>10} {name:>10} {acc:6.3f} {lpd:9.4f} {z:14.3f} {rmin:13.3f} "
            f"{rmax:13.3f} {ok:>7} {secs:7.1f} {gz:16.3f} {gs:17.3f}"
        )
    print(
        "T9 (spec): m: means within 0.2 NUTS posterior sd; sd: mean-field sd <= 1.05 "
        "x NUTS sd. Ratio columns are sd_q / sd_NUTS over the 31 coefficients. vs GVI: the "
        "largest |mean_q - mean_GVI| / sd_NUTS and |log(sd_q / sd_GVI)| (Property 3: "
        "PVI's fixed point is global VI's optimum in the same family)."
    )

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    rounds = np.arange(1, args.rounds + 1)
    for col, split in enumerate(splits):
        for schedule in ("sequential", "synchronous", "asynchronous"):
            curve = curves[(split, schedule)]
            axes[0, col].plot(rounds, curve[:, 0], label=f"PVI {schedule}")
            axes[1, col].plot(rounds, curve[:, 1], label=f"PVI {schedule}")
        gvi = [r for r in rows if r[0] == split and r[1] == "global VI"][0]
        for row, value in ((0, perf["NUTS"][0]), (1, perf["NUTS"][1])):
            axes[row, col].axhline(value, color="k", ls="--", label="NUTS")
            axes[row, col].axhline(
                gvi[2 + row], color="grey", ls=":", label="global VI"
            )
        axes[0, col].set_title(f"{split} silos (J = {args.num_silos})")
        axes[1, col].set_xlabel(f"communication round ({args.num_silos} messages each)")
    axes[0, 0].set_ylabel("test accuracy")
    axes[1, 0].set_ylabel("test log predictive density")
    axes[1, 1].legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    fig.savefig(out / "pvi_logistic.png", dpi=120)
    print(f"saved {out / 'pvi_logistic.png'}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--num-silos", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=80)
    parser.add_argument("--local-steps", type=int, default=50)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--num-particles", type=int, default=4)
    parser.add_argument("--average", type=int, default=20)
    parser.add_argument("--gvi-steps", type=int, default=10000)
    parser.add_argument("--nuts-warmup", type=int, default=500)
    parser.add_argument("--nuts-samples", type=int, default=1000)
    parser.add_argument("--nuts-chains", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output-dir", default=Path(__file__).parent / "output")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.local_steps, args.average, args.gvi_steps = 4, 10, 2, 200
        args.nuts_warmup, args.nuts_samples, args.nuts_chains = 100, 200, 1
    main(args)
