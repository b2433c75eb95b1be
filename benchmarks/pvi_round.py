# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Benchmark: one synchronous PVI round vs k centralized NumPyro SVI steps
======================================================================

A synthetic Bayesian logistic regression (``d`` coefficients, N(0, 1) prior) with
``units_per_silo`` rows in each of J silos. For each J and each number of local steps
k it times one synchronous PVI round (``nf.PVI.update``: every silo vmapped, k Adam
steps on its local free energy from the received q, the server's aggregation and
validity check, in one jitted program plus the wrapper's host-side bookkeeping) and k
steps of NumPyro's ``SVI`` with the same mean-field family on the pooled data (one
jitted ``lax.scan``), in the same process, timed alternately, compile and warm-up
excluded, medians of ``--repeats``. Both do the same number of gradient steps per
row of data: a round is k steps on every silo at once. Wall-clock times are
machine-dependent; the ratio is the result.

Run: ``python benchmarks/pvi_round.py`` (writes ``benchmarks/results/pvi_round.json``).
"""

import argparse
import json
from pathlib import Path

from _timing import interleaved_times, machine_meta  # benchmarks/ is on sys.path
import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import SVI, Trace_ELBO
import optax

import numpyro_fed as nf


def model(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[-1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def synthetic(num_rows, dim, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(num_rows, dim))
    X[:, 0] = 1.0
    logits = X @ rng.normal(size=dim)
    y = (rng.uniform(size=num_rows) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return X.astype(np.float32), y


def bench(num_silos, local_steps, args):
    X, y = synthetic(num_silos * args.units_per_silo, args.dim)
    groups = np.repeat(np.arange(num_silos), args.units_per_silo)
    data = nf.FederatedData.from_groups(groups, X=X, y=y)
    fed = nf.federate(model, silos="data")

    pvi = nf.PVI(
        fed,
        nf.AutoMeanField(fed),
        optax.adam(1e-2),
        local_steps=local_steps,
        schedule="synchronous",
    )
    pvi_state = pvi.init(jax.random.key(0), data)

    def pvi_step(state):
        return pvi.update(state, data)

    pooled = data.pooled()
    svi = SVI(fed, nf.AutoMeanField(fed), optax.adam(1e-2), Trace_ELBO())
    svi_state = svi.init(jax.random.key(0), **pooled)

    @jax.jit
    def svi_steps(state):
        def body(state, _):
            return svi.update(state, **pooled)

        state, losses = jax.lax.scan(body, state, length=local_steps)
        return state, losses[-1]

    t_round, t_svi = interleaved_times(
        [pvi_step, svi_steps], [pvi_state, svi_state], args.repeats
    )
    return {
        "num_silos": num_silos,
        "units": num_silos * args.units_per_silo,
        "dim": args.dim,
        "local_steps": local_steps,
        "pvi_round_ms": 1e3 * t_round,
        "svi_k_steps_ms": 1e3 * t_svi,
        "ratio": t_round / t_svi,
    }


def main(args):
    jax.config.update("jax_enable_x64", args.x64)
    rows = [bench(j, k, args) for j in args.num_silos for k in args.local_steps]
    print(
        f"{'J':>5} {'units':>7} {'k':>4} {'PVI round (ms)':>15} "
        f"{'k SVI steps (ms)':>17} {'ratio':>7}"
    )
    for r in rows:
        print(
            f"{r['num_silos']:>5} {r['units']:>7} {r['local_steps']:>4} "
            f"{r['pvi_round_ms']:>15.3f} {r['svi_k_steps_ms']:>17.3f} "
            f"{r['ratio']:>7.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        **machine_meta(),
        "x64": args.x64,
        "repeats": args.repeats,
        "units_per_silo": args.units_per_silo,
    }
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="PVI round vs k NumPyro SVI steps")
    parser.add_argument("--num-silos", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--local-steps", type=int, nargs="+", default=[1, 10, 50])
    parser.add_argument("--units-per-silo", type=int, default=50)
    parser.add_argument("--dim", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--x64", action="store_true", help="float64 throughout")
    parser.add_argument("--out", default="benchmarks/results/pvi_round.json")
    main(parser.parse_args())
