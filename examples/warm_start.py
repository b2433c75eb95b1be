# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Example: Warm-starting SFVI from a few rounds of SFVI-Avg (Figure S2)
=====================================================================

Hassan et al., Supplement S3.2 (Figure S2): initialising SFVI with a short SFVI-Avg
run (5 rounds of 10^3 local steps, a tenth of SFVI's 5 x 10^4 steps) "can reduce the
number of steps required to reach convergence by a factor of two". This script
measures that in the setting of ``eb_multinomial.py`` (empirical-Bayes softmax
regression on scikit-learn's digits, many small silos): SFVI from scratch against
SFVI started from ``SFVIAvg(...).run(...).params``. The global ELBO is estimated after
every SFVI round with the same 32 draws for both runs (common random numbers), and a
run has converged when it closes a given share of the gap between the scratch run's
first ELBO and the best ELBO either run reaches.

Run: ``python examples/warm_start.py`` (a few minutes on 2 CPU cores); ``--quick`` for
a smoke run (one seed, 5 silos, 30 SFVI rounds).
"""

import argparse

from eb_multinomial import model
import jax
import numpy as np
import optax

import numpyro_fed as nf


def elbo_trace(svi, data, num_steps, evaluate, key, init_params=None):
    """The ELBO of the fitted q after every round (and before the first)."""
    state = svi.init(key, data, init_params=init_params)
    step = jax.jit(svi.update)
    trace = [-float(evaluate(svi.get_params(state)))]
    for _ in range(num_steps):
        state, _ = step(state, data)
        trace.append(-float(evaluate(svi.get_params(state))))
    return np.array(trace)


def steps_to(trace, target):
    """First round after which the ELBO stays at or above ``target`` (None: never)."""
    below = np.flatnonzero(trace < target)
    if below.size == 0:
        return 0
    return None if below[-1] == len(trace) - 1 else int(below[-1]) + 1


def main(args):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    X = (digits.data / 16.0).astype(np.float32)
    X_train, _, y_train, _ = train_test_split(
        X, digits.target, test_size=0.3, random_state=0, stratify=digits.target
    )
    fed = nf.federate(model, silos="data")
    groups = nf.data.split_iid(len(y_train), args.num_silos, seed=0)
    data = nf.FederatedData.from_groups(groups, X=X_train, y=y_train)

    judge = nf.SFVI(fed, nf.AutoMeanField(fed), optax.adam(args.lr), num_particles=32)
    judge_state = judge.init(jax.random.key(99), data)

    @jax.jit
    def evaluate(params):
        server, silos = judge._from_params(params, data)
        return judge.evaluate(judge_state._replace(server=server, silos=silos), data)

    rows = []
    for seed in range(args.num_seeds):
        key = jax.random.key(seed)
        sfvi = nf.SFVI(fed, nf.AutoMeanField(fed), optax.adam(args.lr))
        scratch = elbo_trace(sfvi, data, args.num_steps, evaluate, key)
        avg = nf.SFVIAvg(
            fed, nf.AutoMeanField(fed), optax.adam(args.lr), local_steps=args.avg_steps
        )
        start = avg.run(key, args.avg_rounds, data, progress_bar=False).params
        warm = elbo_trace(sfvi, data, args.num_steps, evaluate, key, init_params=start)
        best = max(scratch.max(), warm.max())
        for share in args.shares:
            target = best - (1 - share) * (best - scratch[0])
            rows.append(
                (seed, share, steps_to(scratch, target), steps_to(warm, target))
            )
        print(
            f"seed {seed}: ELBO first {scratch[0]:.1f}, after SFVI-Avg {warm[0]:.1f}, "
            f"final scratch {scratch[-1]:.1f}, final warm {warm[-1]:.1f}",
            flush=True,
        )

    print(
        f"\nJ = {args.num_silos} silos, Adam {args.lr}; warm start = SFVI-Avg"
        f"({args.avg_steps}) x {args.avg_rounds} rounds "
        f"({args.avg_steps * args.avg_rounds} local steps, {args.avg_rounds} rounds)"
    )
    print(f"{'seed':>4} {'gap closed':>10} {'scratch':>8} {'warm':>6} {'ratio':>6}")
    for seed, share, cold, hot in rows:
        ratio = "-" if not cold or not hot else f"{cold / hot:.2f}"
        print(f"{seed:>4} {share:>10.3f} {cold!s:>8} {hot!s:>6} {ratio:>6}")
    for share in args.shares:
        pairs = [(c, h) for _, s, c, h in rows if s == share and c and h]
        if pairs:
            c, h = np.array(pairs).T
            print(
                f"gap {share}: median SFVI rounds {np.median(c):.0f} from scratch, "
                f"{np.median(h):.0f} warm; ratio {np.median(c / h):.2f} "
                f"(range {np.min(c / h):.2f}-{np.max(c / h):.2f})"
            )
    print("paper (Figure S2, MNIST): about 2x fewer SFVI steps")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--num-silos", type=int, default=25)
    parser.add_argument("--num-steps", type=int, default=2000)
    parser.add_argument("--avg-rounds", type=int, default=5)
    parser.add_argument("--avg-steps", type=int, default=40)
    parser.add_argument("--num-seeds", type=int, default=3)
    parser.add_argument("--shares", type=float, nargs="+", default=[0.99, 0.999])
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.num_silos, args.num_steps, args.num_seeds = 5, 30, 1
        args.avg_rounds, args.avg_steps = 2, 5
    main(args)
