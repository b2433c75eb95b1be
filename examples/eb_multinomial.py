# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Example: Empirical-Bayes multinomial regression, many small vs few large silos
==============================================================================

Hassan et al., Supplement S3.2 (Table S1) on an offline stand-in: scikit-learn's
8x8 digits instead of MNIST. Softmax regression with Gaussian priors whose variances
(sigma_W^2, sigma_b^2) are model parameters theta, learned by empirical Bayes; a
diagonal global Gaussian; no local latents. The training rows are split evenly into
many small silos or a few large ones, and every federated method gets the same budget
of local steps. Reported: mean posterior-predictive accuracy on train and test, as in
the paper's table (which, on MNIST, shows SFVI > SFVI-Avg(many rounds) > SFVI-Avg(one
round) > independent with small silos, and the gap closing with large silos).

Run: ``python examples/eb_multinomial.py`` (a few minutes on 2 CPU cores); ``--quick``
for a smoke run (5 silos, a budget of 100 local steps).
"""

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import constraints
import optax

import numpyro_fed as nf


def model(X, y=None):
    num_classes = 10
    var_w = numpyro.param("var_w", 1.0, constraint=constraints.positive)
    var_b = numpyro.param("var_b", 1.0, constraint=constraints.positive)
    W = numpyro.sample(
        "W",
        dist.Normal(0, jnp.sqrt(var_w)).expand([X.shape[-1], num_classes]).to_event(2),
    )
    b = numpyro.sample(
        "b", dist.Normal(0, jnp.sqrt(var_b)).expand([num_classes]).to_event(1)
    )
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Categorical(logits=X @ W + b), obs=y)


def accuracy(draws, X, y):
    logits = jnp.einsum("nd,sdk->snk", X, draws["W"]) + draws["b"][:, None]
    probs = jax.nn.softmax(logits, -1).mean(0)
    return float(jnp.mean(jnp.argmax(probs, -1) == y))


def main(args):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    X_train, X_test, y_train, y_test = train_test_split(
        X, digits.target, test_size=0.3, random_state=0, stratify=digits.target
    )
    fed = nf.federate(model, silos="data")
    budget = args.budget
    for num_silos in args.num_silos:
        groups = nf.data.split_iid(len(y_train), num_silos, seed=0)
        data = nf.FederatedData.from_groups(groups, X=X_train, y=y_train)
        rows = {}

        def score(svi, params):
            draws = svi.sample_posterior(jax.random.key(1), params, num_samples=200)
            return accuracy(draws, X_train, y_train), accuracy(draws, X_test, y_test)

        sfvi = nf.SFVI(fed, nf.AutoMeanField(fed), optax.adam(args.lr))
        rows[f"SFVI ({budget} rounds)"] = score(
            sfvi, sfvi.run(jax.random.key(0), budget, data, progress_bar=False).params
        )
        for m in (budget, budget // 50):
            avg = nf.SFVIAvg(
                fed, nf.AutoMeanField(fed), optax.adam(args.lr), local_steps=m
            )
            result = avg.run(jax.random.key(0), budget // m, data, progress_bar=False)
            rows[f"SFVI-Avg({m}) x {budget // m}"] = score(avg, result.params)
        fits = nf.baselines.fit_independent(
            fed, nf.AutoMeanField, optax.adam(args.lr), data, jax.random.key(0), budget
        )
        per_silo = [score(f.svi, f.params) for f in fits]
        rows["independent (mean over silos)"] = tuple(np.mean(per_silo, axis=0))
        sizes = sorted(set(data.sizes))
        print(f"\nJ = {num_silos} silos of {sizes} rows (budget {budget} local steps)")
        print(f"{'method':>32} {'train %':>8} {'test %':>8}")
        for name, (train, test) in rows.items():
            print(f"{name:>32} {100 * train:8.1f} {100 * test:8.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--num-silos", type=int, nargs="+", default=[25, 5])
    parser.add_argument("--budget", type=int, default=2000)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.num_silos, args.budget = [5], 100
    main(args)
