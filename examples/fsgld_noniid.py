# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Example: FSGLD vs DSGLD on label-skewed silos, and FSGLD vs NUTS
================================================================

El Mekkaoui et al., §5.3 / Table 1: a Bayesian 18-18-8 ReLU MLP classifier on SUSY
split over 30 silos whose label proportions are drawn from Beta(0.5, 0.5) (non-IID)
or Beta(100, 100) (IID). The paper reports FSGLD's test average log-likelihood far
above DSGLD's on non-IID silos and the two on par on IID silos.

Offline, the data are a SUSY-like stand-in: an 18-feature binary task from
scikit-learn's ``make_classification`` (pass ``--susy path/to/SUSY.csv`` to use a
local copy of the real file). Silos of 3,000 rows (the paper's "9e4 samples" read
as the total); weight prior N(0, 1); h = 1e-4, m = 50, tau = 40, as in the paper;
300 rounds (12,000 steps), the first half discarded, thinning 20. In this regime
DSGLD's network goes dead (every unit of the last hidden layer off) and its output
bias follows the label mix of whichever silo holds the chain: the paper's pathology.

Surrogates (``--surrogates``): by default diagonal Laplace approximations of each
silo's likelihood times ``1/30`` of the prior (``prior_power``: a silo holding one
class has an improper likelihood; with uniform silo probabilities the prior shares
cancel in the conducive gradient), each fitted from the last state of a 50-round
DSGLD run (``--warm-rounds``), where both samplers also start. ``sgld`` gives the
paper's choice, diagonal Gaussians moment-matched to 3,000 local Langevin draws
(thinned by 10); in this regime they make FSGLD diverge (docs/fsgld.md says why).
Both readings of "average log-likelihood" are printed (posterior predictive, and
per draw); see docs/fsgld.md for what they show.

Part 2 runs FSGLD and NUTS on a federated logistic regression (IID silos), prints
``nf.compare`` and saves an ArviZ trace plot to ``--output-dir`` (default
``examples/output/``), then compares
FSGLD and DSGLD with NUTS on label-skewed silos.

Run: ``python examples/fsgld_noniid.py`` (about an hour on 2 CPU cores, most of it
the Laplace fits, 2 to 8 minutes per seed and split); ``--quick`` is a smoke run of
the same code on small data (non-IID silos only, 1 seed, 3 silos of 200 rows, a 4-4
hidden network, 4 rounds; part 2 on 1,000 rows and one tau), far too short to show
the ordering.
"""

import argparse
import functools
from pathlib import Path
import time

import arviz as az
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS

import numpyro_fed as nf

HIDDEN = (18, 8)
# Beta(a, b) of the silos' label proportions.
SETTINGS = {"non-IID": (0.5, 0.5), "IID": (100.0, 100.0)}


def mlp(X, y, hidden=HIDDEN):
    """An 18-18-8 ReLU MLP (``hidden``: the hidden widths) with N(0, 1) weights and a
    Bernoulli output."""
    sizes = (X.shape[-1],) + tuple(hidden) + (1,)
    weights = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        w = numpyro.sample(f"w{i}", dist.Normal(0, 1).expand([a, b]).to_event(2))
        c = numpyro.sample(f"b{i}", dist.Normal(0, 1).expand([b]).to_event(1))
        weights.append((w, c))
    with nf.silo_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=forward(weights, X)), obs=y)


def forward(weights, X):
    h = X
    for w, c in weights[:-1]:
        h = jax.nn.relu(h @ w + c)
    w, c = weights[-1]
    return (h @ w + c)[..., 0]


def log_liks(samples, X, y):
    """The two averages the paper's "average log-likelihood" can mean: over points of
    log E_w p(y | x, w) (the posterior predictive), and over points and draws of
    log p(y | x, w) (each draw scored on its own; a chain that swings between
    confident silo-specific models scores badly here even when its draws average
    to a good predictor)."""
    n = sum(1 for k in samples if k.startswith("w"))

    def logits(s):
        return forward([(s[f"w{i}"], s[f"b{i}"]) for i in range(n)], X)

    ll = jax.vmap(lambda s: dist.Bernoulli(logits=logits(s)).log_prob(y))(samples)
    predictive = jnp.mean(jax.scipy.special.logsumexp(ll, 0) - jnp.log(ll.shape[0]))
    return float(predictive), float(jnp.mean(ll))


def load(args, rng):
    if args.susy:
        from numpyro_fed.datasets import susy

        data = susy(args.susy, num_rows=args.num_rows)
        X, y = data.X, data.y
    else:
        from sklearn.datasets import make_classification

        X, y = make_classification(
            n_samples=args.num_rows,
            n_features=18,
            n_informative=8,
            n_redundant=6,
            flip_y=0.1,
            class_sep=0.8,
            random_state=int(rng.integers(1 << 31)),
        )
    X = (X - X.mean(0)) / X.std(0)
    return X, y.astype(float)


def beta_split(y, num_silos, size, a, b, rng):
    """Silo s gets round(size * p_s) positives and the rest negatives, p_s ~ Beta(a, b),
    drawn without replacement (units not drawn are left out)."""
    pos, neg = (
        rng.permutation(np.flatnonzero(y == 1)),
        rng.permutation(np.flatnonzero(y == 0)),
    )
    groups = np.full(len(y), -1)
    used_pos = used_neg = 0
    for s, p in enumerate(rng.beta(a, b, size=num_silos)):
        k = int(round(size * p))
        groups[pos[used_pos : used_pos + k]] = s
        groups[neg[used_neg : used_neg + size - k]] = s
        used_pos, used_neg = used_pos + k, used_neg + size - k
    return groups


def table1(args):
    model = functools.partial(mlp, hidden=args.hidden)
    rows = []
    for setting in args.settings:
        a, b = SETTINGS[setting]
        for seed in range(args.seeds):
            rng = np.random.default_rng(seed)
            X, y = load(args, rng)
            test = rng.choice(len(y), args.num_test, replace=False)
            train = np.setdiff1d(np.arange(len(y)), test)
            groups = beta_split(y[train], args.num_silos, args.silo_size, a, b, rng)
            keep = groups >= 0
            Xtr, ytr = X[train][keep], y[train][keep]
            data = nf.FederatedData.from_groups(groups[keep], X=Xtr, y=ytr)
            # Every silo starts its surrogate fit, and both samplers start, from the
            # end of a short DSGLD run: a common point keeps the silos' Gaussians in
            # one basin of the network's weight symmetries.
            z0 = None
            if args.warm_rounds:
                warm = MCMC(
                    nf.DSGLD(model, args.step_size, args.tau, batch_size=50),
                    num_warmup=0,
                    num_samples=args.warm_rounds * args.tau,
                    progress_bar=False,
                )
                warm.run(jax.random.key(200 + seed), data)
                z0 = jax.tree.map(lambda v: v[-1], warm.get_samples())
            start = time.perf_counter()
            if args.surrogates == "laplace":
                # At most 25 Newton steps (25 Hessians) per silo: a silo whose
                # target is far from convex at the start can otherwise wander for
                # hundreds of steps; seed 0's result is the same with 500.
                fit = dict(
                    method="laplace", num_steps=args.laplace_steps, silo_batch_size=2
                )
            else:
                fit = dict(
                    method="sgld",
                    step_size=args.local_step_size,
                    num_warmup=args.local_warmup,
                    num_samples=3000,
                    thinning=args.local_thinning,
                    rng_key=jax.random.key(seed),
                    silo_batch_size=10,
                )
            q = nf.fit_surrogates(
                model,
                data,
                covariance="diag",
                prior_power=1.0 / args.num_silos,
                init_params=z0,
                **fit,
            )
            fit_s = time.perf_counter() - start
            steps = args.rounds * args.tau
            for name in ("FSGLD", "DSGLD"):
                if name == "FSGLD":
                    kernel = nf.FSGLD(
                        model,
                        args.step_size,
                        q,
                        args.tau,
                        alpha=args.alpha,
                        batch_size=50,
                    )
                else:
                    kernel = nf.DSGLD(model, args.step_size, args.tau, batch_size=50)
                mcmc = MCMC(
                    kernel,
                    num_warmup=steps // 2,
                    num_samples=steps // 2,
                    thinning=args.thinning,
                    progress_bar=False,
                )
                start = time.perf_counter()
                mcmc.run(jax.random.key(100 + seed), data, init_params=z0)
                samples = mcmc.get_samples()
                test_pred, test_draw = log_liks(samples, X[test], y[test])
                train_pred, train_draw = log_liks(samples, Xtr, ytr)
                row = {
                    "setting": setting,
                    "seed": seed,
                    "method": name,
                    "test": test_pred,
                    "train": train_pred,
                    "test_per_draw": test_draw,
                    "train_per_draw": train_draw,
                    "seconds": time.perf_counter() - start,
                    "fit_seconds": fit_s,
                }
                rows.append(row)
                print(
                    f"{setting:>8} seed {seed} {name}: predictive test "
                    f"{row['test']:.3f}, train {row['train']:.3f}; per draw test "
                    f"{row['test_per_draw']:.4g}, train {row['train_per_draw']:.4g} "
                    f"({row['seconds']:.0f} s; surrogates {fit_s:.0f} s)",
                    flush=True,
                )
    print("\nAverage log-likelihood, mean +- std over seeds")
    for setting in args.settings:
        for name in ("FSGLD", "DSGLD"):
            sel = [r for r in rows if r["setting"] == setting and r["method"] == name]
            cells = []
            for key in ("test", "train", "test_per_draw", "train_per_draw"):
                v = np.array([r[key] for r in sel])
                cells.append(f"{key} {v.mean():.4g} +- {v.std():.3g}")
            print(f"{setting:>8} {name}: " + ", ".join(cells))
    return rows


def logistic(X, y):
    beta = numpyro.sample("beta", dist.Normal(0, 2).expand([X.shape[-1]]).to_event(1))
    with nf.silo_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ beta), obs=y)


def against_nuts(args):
    """FSGLD (IID silos) against NUTS with nf.compare and an ArviZ trace plot, then
    FSGLD and DSGLD on label-skewed silos for each tau in ``--taus``."""
    from sklearn.datasets import make_classification

    X, y = make_classification(
        n_samples=args.compare_rows,
        n_features=5,
        n_informative=5,
        n_redundant=0,
        random_state=1,
    )
    X = np.c_[np.ones(len(y)), (X - X.mean(0)) / X.std(0)]
    y = y.astype(float)
    nuts = MCMC(
        NUTS(logistic),
        num_warmup=args.reference_warmup,
        num_samples=args.reference_samples,
        progress_bar=False,
    )
    nuts.run(jax.random.key(1), X=X, y=y)

    def run(kernel, data):
        mcmc = MCMC(
            kernel,
            num_warmup=args.sgld_warmup,
            num_samples=args.nuts_steps,
            num_chains=4,
            chain_method="vectorized",
            thinning=10,
            progress_bar=False,
        )
        mcmc.run(jax.random.key(0), data)
        return mcmc

    h, m = 2e-5, 100  # h * (largest curvature) ~ 0.02; m = 100 rows per step
    iid = nf.FederatedData.from_groups(nf.data.split_iid(len(y), 10, seed=0), X=X, y=y)
    q = nf.fit_surrogates(logistic, iid, prior_power=0.1)  # f_s = 1/10
    fsgld = run(nf.FSGLD(logistic, h, q, tau=10, batch_size=m), iid)
    print("\nFSGLD (10 IID silos, tau = 10, 4 chains) vs NUTS on the pooled data:")
    fsgld.print_summary()
    print(nf.format_compare(nf.compare(fsgld, nuts, labels=("fsgld", "nuts"))))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    plot = az.plot_trace_dist(az.from_numpyro(fsgld))
    plot.savefig(out / "fsgld_trace.png")
    print(f"trace plot: {out / 'fsgld_trace.png'}")

    skew = nf.data.split_label_skew(y, 10, dominant=0.9, seed=0)
    skewed = nf.FederatedData.from_groups(skew, X=X, y=y)
    q = nf.fit_surrogates(logistic, skewed, prior_power=0.1)
    print("\nLabel-skewed silos (90% one class): max |mean - NUTS| in NUTS sds, and")
    print("the sd ratio to NUTS of the intercept and (max) of the slopes")
    for tau in args.taus:
        for name in ("FSGLD", "DSGLD"):
            if name == "FSGLD":
                kernel = nf.FSGLD(logistic, h, q, tau=tau, batch_size=m)
            else:
                kernel = nf.DSGLD(logistic, h, tau=tau, batch_size=m)
            table = nf.compare(run(kernel, skewed), nuts)
            ratios = table["sd_ratio"].to_numpy()
            print(
                f"  tau={tau:<3} {name}: mean {table.attrs['max_abs_mean_diff_sd']:.2f} "
                f"sd, sd ratio intercept {ratios[0]:.2f}, slopes {ratios[1:].max():.2f}"
            )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--susy", help="path to a local SUSY.csv (default: stand-in)")
    parser.add_argument(
        "--num-rows",
        type=int,
        help="rows to generate (default 35 x silo size, >= 20000)",
    )
    parser.add_argument("--num-test", type=int, default=2000)
    parser.add_argument(
        "--hidden", type=int, nargs="+", default=list(HIDDEN), help="hidden widths"
    )
    parser.add_argument("--num-silos", type=int, default=30)
    parser.add_argument(
        "--silo-size",
        type=int,
        default=3000,
        help="rows per silo (3000: the paper's 9e4 rows in total)",
    )
    parser.add_argument(
        "--surrogates",
        choices=("laplace", "sgld"),
        default="laplace",
        help="laplace: each silo's mode and curvature; sgld: moments of 3,000 local "
        "Langevin draws, as in the paper",
    )
    parser.add_argument(
        "--laplace-steps", type=int, default=25, help="Newton steps per silo"
    )
    parser.add_argument(
        "--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS)
    )
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--tau", type=int, default=40)
    parser.add_argument("--thinning", type=int, default=20)
    parser.add_argument("--step-size", type=float, default=1e-4)
    parser.add_argument("--alpha", type=float, default=1.0)
    parser.add_argument("--local-step-size", type=float, default=1e-3)
    parser.add_argument("--local-warmup", type=int, default=2000)
    parser.add_argument(
        "--local-thinning",
        type=int,
        default=10,
        help="Langevin steps per surrogate draw (1 gives overconfident surrogates)",
    )
    parser.add_argument(
        "--warm-rounds",
        type=int,
        default=50,
        help="DSGLD rounds whose last state starts the surrogate fits and both "
        "samplers (0: the model's default initial values)",
    )
    parser.add_argument(
        "--nuts-steps", type=int, default=40000, help="part 2: SGLD steps per chain"
    )
    parser.add_argument("--sgld-warmup", type=int, default=5000, help="part 2")
    parser.add_argument("--taus", type=int, nargs="+", default=[1, 10], help="part 2")
    parser.add_argument("--compare-rows", type=int, default=5000, help="part 2")
    parser.add_argument(
        "--reference-warmup", type=int, default=1000, help="part 2: NUTS warmup"
    )
    parser.add_argument(
        "--reference-samples", type=int, default=2000, help="part 2: NUTS draws"
    )
    parser.add_argument("--output-dir", default=Path(__file__).parent / "output")
    parser.add_argument("--quick", action="store_true", help="a short smoke run")
    args = parser.parse_args()
    if args.quick:
        args.seeds, args.rounds, args.warm_rounds, args.local_warmup = 1, 4, 2, 200
        args.laplace_steps, args.hidden, args.settings = 3, [4, 4], ["non-IID"]
        args.num_silos, args.silo_size, args.num_test = 3, 200, 200
        args.num_rows = args.num_rows or 1000
        args.compare_rows = 1000
        args.reference_warmup, args.reference_samples = 200, 200
        args.sgld_warmup, args.nuts_steps, args.taus = 500, 500, [10]
    if args.num_rows is None:
        args.num_rows = max(20000, 35 * args.silo_size)
    numpyro.enable_x64()
    table1(args)
    against_nuts(args)


if __name__ == "__main__":
    main()
