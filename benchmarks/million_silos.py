# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Benchmark: SFVI on up to a million one-unit silos
=================================================

The logistic GLMM of ``sfvi_round.py`` (a random intercept per child, 4 visits, 4
covariates) with one child per silo, so ``J`` silos hold ``J`` units. For each ``J``
it measures, in a fresh process (so that peak memory is that run's own):

- **data**: ``FederatedData.from_groups`` on shuffled silo labels;
- **init**: ``SFVI.init`` with the default ``AutoGlobalLocalNormal`` guide (model analysis,
  guide set-up and the compiled initial states);
- **first round**: the first ``update`` (compiles the round);
- **round**: the median of the next ``--rounds`` calls of ``update``;
- **peak RSS**: the process's maximum resident set size (``resource.getrusage``).

Set-up is data + init. Wall-clock times are machine-dependent (and the load on it):
say how the machine was loaded when quoting them.

Run: ``python benchmarks/million_silos.py`` (writes
``benchmarks/results/million_silos.json``).
"""

import argparse
import json
from pathlib import Path
import resource
import subprocess
import sys
import time

from _timing import machine_meta  # benchmarks/ is on sys.path
import jax
import numpy as np
import optax

import numpyro_fed as nf


def one(num_silos: int, rounds: int) -> dict:
    """Every measurement for ``num_silos`` one-unit silos, in this process."""
    from sfvi_round import model, synthetic  # benchmarks/ is on sys.path

    X, y = synthetic(num_silos)
    labels = np.random.default_rng(1).permutation(num_silos)
    start = time.perf_counter()
    data = nf.FederatedData.from_groups(labels, X=X, y=y)
    jax.block_until_ready(data)
    t_data = time.perf_counter() - start

    fed = nf.federate(model, silos="child")
    svi = nf.SFVI(fed, nf.AutoGlobalLocalNormal(fed), optax.adam(1e-2))
    start = time.perf_counter()
    state = jax.block_until_ready(svi.init(jax.random.key(0), data))
    t_init = time.perf_counter() - start

    start = time.perf_counter()
    state, loss = jax.block_until_ready(svi.update(state, data))
    t_first = time.perf_counter() - start
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        state, loss = jax.block_until_ready(svi.update(state, data))
        times.append(time.perf_counter() - start)
    if not np.isfinite(float(loss)):
        raise RuntimeError(f"the loss at J={num_silos} is not finite: {loss}")
    return {
        "num_silos": num_silos,
        "data_s": t_data,
        "init_s": t_init,
        "setup_s": t_data + t_init,
        "first_round_s": t_first,
        "round_s": float(np.median(times)),
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }


def main(args):
    rows = []
    for num_silos in args.num_silos:
        # A fresh process per size: ru_maxrss is the peak of the whole process.
        out = subprocess.run(
            [sys.executable, __file__, "--one", str(num_silos)]
            + ["--rounds", str(args.rounds)],
            check=True,
            capture_output=True,
            text=True,
        )
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"J={num_silos} done", flush=True)
    head = ("J", "data (s)", "init (s)", "set-up (s)", "round 1 (s)", "round (s)")
    print(f"{head[0]:>9}" + "".join(f"{h:>12}" for h in head[1:]) + f"{'RSS (GB)':>10}")
    for r in rows:
        cells = ("data_s", "init_s", "setup_s", "first_round_s", "round_s")
        print(
            f"{r['num_silos']:>9}"
            + "".join(f"{r[c]:>12.3f}" for c in cells)
            + f"{r['peak_rss_gb']:>10.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        **machine_meta(),
        "note": args.note,
    }
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="SFVI on a million one-unit silos")
    parser.add_argument(
        "--num-silos", type=int, nargs="+", default=[100_000, 300_000, 1_000_000]
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--note", default="", help="how the machine was loaded")
    parser.add_argument("--out", default="benchmarks/results/million_silos.json")
    parsed = parser.parse_args()
    if parsed.one is not None:
        print(json.dumps(one(parsed.one, parsed.rounds)))
    else:
        main(parsed)
