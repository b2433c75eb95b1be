# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Benchmark: communication to convergence, SFVI vs SFVI-Avg(m)
=============================================================

A synthetic logistic GLMM (random intercept per child) on J silos. For SFVI and for
SFVI-Avg with several numbers of local steps m, it records the global ELBO (estimated
with 32 draws of the fitted q at every round) and counts the communication rounds and
bytes (both directions, all silos) needed to close 99% of the gap between the initial
ELBO and the best ELBO any method reached. Bytes are the sizes of the typed message
pytrees, so they count exactly what crosses the wire in a deployment.

Run: ``python benchmarks/sfvi_avg_rounds.py`` (writes
``benchmarks/results/sfvi_avg_rounds.json``).
"""

import argparse
import datetime
import json
from pathlib import Path

import jax
import numpy as np
import optax
from sfvi_round import model, synthetic

import numpyro_fed as nf
from numpyro_fed.protocol import silo_data_of


def message_bytes(svi, state, data):
    """Bytes of one round's messages: the broadcast to every silo plus every reply."""
    algorithm, _ = svi._build(data)
    _, keys, silo_keys = svi._round_keys(state.rng_key, data.num_silos)
    message = algorithm.server_message(state.server, keys)
    first = jax.tree.map(lambda x: x[0], (state.silos, silo_data_of(data)))
    reply = jax.eval_shape(algorithm.silo_step, message, *first, silo_keys[0])[0]

    def size(tree):
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))

    return data.num_silos * (size(message) + size(reply))


def elbo_trace(svi, data, num_rounds, evaluator, key):
    state = svi.init(key, data)
    per_round = message_bytes(svi, state, data)
    step = jax.jit(svi.update)
    trace = []
    for _ in range(num_rounds):
        state, _ = step(state, data)
        params = svi.get_params(state)
        trace.append(-float(evaluator(params)))
    return np.array(trace), per_round


def main(args):
    X, y = synthetic(args.num_silos * args.units_per_silo)
    groups = np.repeat(np.arange(args.num_silos), args.units_per_silo)
    data = nf.FederatedData.from_groups(groups, X=X, y=y)
    fed = nf.federate(model, silos="child")
    judge = nf.SFVI(
        fed, nf.AutoGlobalLocalNormal(fed), optax.adam(1e-2), num_particles=32
    )
    judge_state = judge.init(jax.random.key(99), data)

    @jax.jit
    def evaluate(params):
        # The same 32 draws every time: common random numbers across rounds and methods.
        server, silos = judge._from_params(params, data)
        return judge.evaluate(judge_state._replace(server=server, silos=silos), data)

    runs = {}
    optim = optax.adam(args.lr)
    sfvi = nf.SFVI(fed, nf.AutoGlobalLocalNormal(fed), optim)
    runs["SFVI"] = elbo_trace(sfvi, data, args.sfvi_rounds, evaluate, jax.random.key(0))
    for m in args.local_steps:
        avg = nf.SFVIAvg(fed, nf.AutoGlobalLocalNormal(fed), optim, local_steps=m)
        rounds = max(args.sfvi_rounds // m, 10)
        runs[f"SFVI-Avg({m})"] = elbo_trace(
            avg, data, rounds, evaluate, jax.random.key(0)
        )
    best = max(trace.max() for trace, _ in runs.values())
    start = min(trace[0] for trace, _ in runs.values())
    target = best - 0.01 * (best - start)
    rows = []
    print(f"ELBO: first round >= {start:.1f}, best {best:.1f}, target {target:.1f}")
    print(f"{'method':>16} {'rounds':>7} {'MB':>9} {'final ELBO':>11}")
    for name, (trace, per_round) in runs.items():
        hit = np.flatnonzero(trace >= target)
        rounds = int(hit[0]) + 1 if hit.size else None
        mb = None if rounds is None else rounds * per_round / 1e6
        rows.append(
            {
                "method": name,
                "rounds_to_99pct": rounds,
                "megabytes": mb,
                "bytes_per_round": per_round,
                "final_elbo": float(trace[-1]),
            }
        )
        shown = "not reached" if rounds is None else f"{rounds:>7} {mb:>9.3f}"
        print(f"{name:>16} {shown} {trace[-1]:>11.1f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    summary = {
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "first_elbo": float(start),
        "best_elbo": float(best),
        "args": vars(args),
        "results": rows,
    }
    out.write_text(json.dumps(summary, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="rounds and bytes to 99% ELBO")
    parser.add_argument("--num-silos", type=int, default=10)
    parser.add_argument("--units-per-silo", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--sfvi-rounds", type=int, default=1500)
    parser.add_argument("--local-steps", type=int, nargs="+", default=[10, 50, 250])
    parser.add_argument("--out", default="benchmarks/results/sfvi_avg_rounds.json")
    main(parser.parse_args())
