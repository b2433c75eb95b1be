# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Example: Hierarchical BNN on label-skewed silos (Table 1 design)
================================================================

Hassan et al., §4.1 (Table 1, on MNIST) on an offline stand-in: scikit-learn's 8x8
digits. Every silo holds 90% of one digit and 10% spread over the others, in its
training *and* its test shard, so accuracy is personalised. The model is the paper's
hierarchical BNN:

.. math::

    \\mu_{dh} \\sim N(0, 1), \\quad \\sigma \\sim N_+(0, 1), \\quad
    \\epsilon^{(j)}_{dh} \\sim N(0, 1), \\quad W^{(2, j)}_{hk} \\sim N(0, 1), \\quad
    W^{(1, j)} = \\mu + \\sigma \\epsilon^{(j)},

    y \\mid x \\sim \\text{Categorical}(\\text{softmax}(W^{(2, j)\\top}
    \\text{ReLU}(W^{(1, j)\\top} x))).

The shared first-layer means :math:`\\mu` and the scale :math:`\\sigma` are global
latents; each silo's non-centred offsets :math:`\\epsilon^{(j)}` and second layer
:math:`W^{(2, j)}` are its local latents (one unit of the silo plate per silo). The
guide is mean-field Gaussian, as in the paper. For each of several random partitions
the script fits SFVI, SFVI-Avg (20 rounds, the same budget of local steps) and
independent per-silo VI, and reports per-silo test accuracy (posterior predictive
mean): the mean over silos and partitions, the spread across silos, and the spread of
the partition means.

Run: ``python examples/bnn_label_skew.py`` (a few minutes on 2 CPU cores);
``--num-silos 10 50 --num-steps 10000`` for the paper's sizes; ``--quick`` for a
smoke run (one partition, 40 local steps).
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer.initialization import init_to_uniform
import optax

import numpyro_fed as nf

# Hassan et al., Table 1 (MNIST, five runs): accuracy % (sd).
PAPER = {
    10: {"SFVI": "97.5 (0.50)", "SFVI-Avg": "96.6 (0.68)"},
    50: {"SFVI": "96.0 (1.03)", "SFVI-Avg": "93.6 (1.68)"},
}


def model(X, y=None, hidden=32, num_classes=10):
    """One unit of the "silo" plate per silo: ``X`` is ``(J, n, D)``, ``y`` ``(J, n)``."""
    num_features = X.shape[-1]
    mu = numpyro.sample(
        "mu", dist.Normal(0, 1).expand([num_features, hidden]).to_event(2)
    )
    sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
    with numpyro.plate("silo", X.shape[0], dim=-2):
        eps = numpyro.sample(
            "eps", dist.Normal(0, 1).expand([num_features, hidden]).to_event(2)
        )
        w2 = numpyro.sample(
            "w2", dist.Normal(0, 1).expand([hidden, num_classes]).to_event(2)
        )
        # The silo plate sits at dim -2 (rows nest at -1), so each silo's draws
        # carry a singleton batch axis: (J, 1, D, H).
        w1 = mu + sigma * eps[:, 0]
        logits = jnp.einsum(
            "jnh,jhk->jnk", jax.nn.relu(jnp.einsum("jnd,jdh->jnh", X, w1)), w2[:, 0]
        )
        with numpyro.plate("row", X.shape[1], dim=-1):
            numpyro.sample("y", dist.Categorical(logits=logits), obs=y)


def predictive_accuracy(mu, sigma, eps, w2, X, y):
    """Posterior-predictive accuracy of one silo: draws ``mu (S, D, H)``,
    ``sigma (S,)``, ``eps (S, D, H)``, ``w2 (S, H, K)``; test rows ``X (n, D)``."""
    w1 = mu + sigma[:, None, None] * eps
    hidden = jax.nn.relu(jnp.einsum("nd,sdh->snh", X, w1))
    probs = jax.nn.softmax(jnp.einsum("snh,shk->snk", hidden, w2), -1).mean(0)
    return float(jnp.mean(jnp.argmax(probs, -1) == y))


def shards(X, y, num_silos, seed):
    """Label-skewed shards of equal size (rows that do not divide evenly are
    dropped): ``(J, n, D)`` and ``(J, n)``, silo ``j`` dominated by digit ``j % 10``."""
    n = len(y) // num_silos
    ids = nf.data.split_label_skew(y[: n * num_silos], num_silos, 0.9, seed=seed)
    rows = [np.flatnonzero(ids == j) for j in range(num_silos)]
    return np.stack([X[r] for r in rows]), np.stack([y[r] for r in rows])


def model_independent(X, y=None, hidden=32, num_classes=10):
    """The same BNN with every latent inside the silo plate: each silo has its own
    ``mu`` and ``sigma``. Its ELBO is a sum of per-silo ELBOs over disjoint
    parameters, and Adam and the mean-field guide act elementwise, so one SFVI run of
    this model *is* independent per-silo VI (``nf.baselines.fit_independent``), done in one
    compiled, vmapped program instead of ``J``."""
    num_features = X.shape[-1]
    with numpyro.plate("silo", X.shape[0], dim=-2):
        mu = numpyro.sample(
            "mu", dist.Normal(0, 1).expand([num_features, hidden]).to_event(2)
        )
        sigma = numpyro.sample("sigma", dist.HalfNormal(1.0))
        eps = numpyro.sample(
            "eps", dist.Normal(0, 1).expand([num_features, hidden]).to_event(2)
        )
        w2 = numpyro.sample(
            "w2", dist.Normal(0, 1).expand([hidden, num_classes]).to_event(2)
        )
        w1 = mu[:, 0] + sigma[:, 0, None, None] * eps[:, 0]
        logits = jnp.einsum(
            "jnh,jhk->jnk", jax.nn.relu(jnp.einsum("jnd,jdh->jnh", X, w1)), w2[:, 0]
        )
        with numpyro.plate("row", X.shape[1], dim=-1):
            numpyro.sample("y", dist.Categorical(logits=logits), obs=y)


def per_silo_accuracy(draws, X_test, y_test):
    """Test accuracy of every silo from joint posterior draws (pooled layout: the
    silo plate's units are the silos, in order)."""
    accs = []
    for j in range(len(y_test)):
        mu, sigma = draws["mu"], draws["sigma"]
        if mu.ndim == 5:  # per-silo globals (the independent model)
            mu, sigma = mu[:, j, 0], sigma[:, j, 0]
        eps, w2 = draws["eps"][:, j, 0], draws["w2"][:, j, 0]
        accs.append(predictive_accuracy(mu, sigma, eps, w2, X_test[j], y_test[j]))
    return accs


def fit_partition(args, data, X_test, y_test, seed):
    """Per-silo test accuracies and wall times of every method on one partition."""
    fed = nf.federate(model, silos="silo")
    m = args.num_steps // args.avg_rounds
    methods = {
        "SFVI": (fed, nf.SFVI, {}, args.num_steps),
        f"SFVI-Avg({m})x{args.avg_rounds}": (
            fed,
            nf.SFVIAvg,
            {"local_steps": m},
            args.avg_rounds,
        ),
        f"SFVI-Avg({m})x{args.avg_rounds}, literal": (
            fed,
            nf.SFVIAvg,
            {"local_steps": m, "scale_local_entropy": False},
            args.avg_rounds,
        ),
        "independent": (
            nf.federate(model_independent, silos="silo"),
            nf.SFVI,
            {},
            args.num_steps,
        ),
    }
    accs, times = {}, {}
    for name, (fed_model, cls, kwargs, rounds) in methods.items():
        start = time.perf_counter()
        guide = nf.AutoMeanField(fed_model, init_loc_fn=init_to_uniform(radius=0.5))
        svi = cls(fed_model, guide, optax.adam(args.lr), **kwargs)
        fit = svi.run(jax.random.key(seed), rounds, data, progress_bar=False)
        draws = svi.sample_posterior(
            jax.random.key(1), fit.params, data, num_samples=100
        )
        accs[name] = per_silo_accuracy(draws, X_test, y_test)
        times[name] = time.perf_counter() - start
    return accs, times


def main(args):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    X_train, X_test, y_train, y_test = train_test_split(
        X, digits.target, test_size=0.3, random_state=0, stratify=digits.target
    )
    for num_silos in args.num_silos:
        results = {}
        for p in range(args.num_partitions):
            Xs, ys = shards(X_train, y_train, num_silos, seed=p)
            Xt, yt = shards(X_test, y_test, num_silos, seed=p)
            data = nf.FederatedData.from_groups(np.arange(num_silos), X=Xs, y=ys)
            accs, times = fit_partition(args, data, Xt, yt, seed=p)
            # The floor every method must clear: predict the silo's commonest label.
            major = [np.bincount(t).argmax() for t in ys]
            accs["majority label"] = [
                np.mean(t == c) for t, c in zip(yt, major, strict=True)
            ]
            for name, a in accs.items():
                results.setdefault(name, []).append(a)
            summary = ", ".join(
                f"{k} {100 * np.mean(v):.1f}%"
                + (f" ({times[k]:.0f} s)" if k in times else "")
                for k, v in accs.items()
            )
            print(f"J = {num_silos}, partition {p}: {summary}", flush=True)
        print(
            f"\nJ = {num_silos} silos, {Xs.shape[1]} train / {Xt.shape[1]} test rows "
            f"each, {args.num_partitions} partitions, {args.num_steps} local steps, "
            f"Adam {args.lr}"
        )
        print(
            f"{'method':>30} {'acc %':>6} {'sd silos':>9} {'sd runs':>8}  paper (MNIST)"
        )
        for name, accs in results.items():
            accs = 100 * np.asarray(accs)  # (partitions, silos)
            key = name.split("(")[0] if "literal" not in name else None
            paper = PAPER.get(num_silos, {}).get(key, "-")
            print(
                f"{name:>30} {accs.mean():6.1f} {accs.std(axis=1).mean():9.2f} "
                f"{accs.mean(axis=1).std():8.2f}  {paper}"
            )
        print(
            "sd silos: sd of per-silo accuracy within a partition, averaged over "
            "partitions; sd runs: sd of the partition means."
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--num-silos", type=int, nargs="+", default=[10])
    parser.add_argument("--num-partitions", type=int, default=5)
    parser.add_argument("--num-steps", type=int, default=2000)
    parser.add_argument("--avg-rounds", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.num_silos, args.num_partitions = [10], 1
        args.num_steps, args.avg_rounds = 40, 4
    main(args)
