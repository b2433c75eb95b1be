# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Benchmark: one SFVI round vs one centralized NumPyro SVI step
=============================================================

A synthetic logistic GLMM (a random intercept per child, 4 visits, 4 covariates) with
``units_per_silo`` children in each of J silos. For J in (10, 100, 1000) it times one
simulated SFVI round (all silos vmapped, the round jitted) and one step of NumPyro's
``SVI`` with the same guide on the pooled data, in the same process, and reports
their ratio. Wall-clock times are machine-dependent; the ratio is the result.

Run: ``python benchmarks/sfvi_round.py`` (writes ``benchmarks/results/sfvi_round.json``).
"""

import argparse
import json
import os
from pathlib import Path
import platform

from _timing import interleaved_times  # benchmarks/ is on sys.path
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import SVI, Trace_ELBO
import optax

import numpyro_fed as nf


def model(X, y=None):
    beta = numpyro.sample("beta", dist.Normal(0, 10).expand([X.shape[-1]]).to_event(1))
    omega = numpyro.sample("omega", dist.Normal(0, 10))
    with numpyro.plate("child", X.shape[0], dim=-2):
        b = numpyro.sample("b", dist.Normal(0, jnp.exp(-omega)))
        with numpyro.plate("visit", X.shape[1], dim=-1):
            numpyro.sample("y", dist.Bernoulli(logits=X @ beta + b), obs=y)


def synthetic(num_children, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(num_children, 4, 4))
    X[..., 0] = 1.0
    logits = X @ np.array([-1.0, 0.5, -0.3, 0.2]) + rng.normal(size=(num_children, 1))
    y = (rng.uniform(size=logits.shape) < 1 / (1 + np.exp(-logits))).astype(np.float32)
    return X.astype(np.float32), y


def bench(num_silos, units_per_silo, repeats):
    X, y = synthetic(num_silos * units_per_silo)
    groups = np.repeat(np.arange(num_silos), units_per_silo)
    data = nf.FederatedData.from_groups(groups, X=X, y=y)
    fed = nf.federate(model, silos="child")

    sfvi = nf.SFVI(fed, nf.AutoStructured(fed), optax.adam(1e-2))
    sfvi_state = sfvi.init(jax.random.key(0), data)
    sfvi_step = jax.jit(lambda s: sfvi.update(s, data))

    pooled = data.pooled()
    svi = SVI(fed, nf.AutoStructured(fed), optax.adam(1e-2), Trace_ELBO())
    svi_state = svi.init(jax.random.key(0), **pooled)
    svi_step = jax.jit(lambda s: svi.update(s, **pooled))
    t_round, t_svi = interleaved_times(
        [sfvi_step, svi_step], [sfvi_state, svi_state], repeats
    )
    return {
        "num_silos": num_silos,
        "units": num_silos * units_per_silo,
        "sfvi_round_ms": 1e3 * t_round,
        "svi_step_ms": 1e3 * t_svi,
        "ratio": t_round / t_svi,
    }


def main(args):
    rows = [bench(j, args.units_per_silo, args.repeats) for j in args.num_silos]
    print(
        f"{'J':>6} {'units':>7} {'SFVI round (ms)':>16} {'SVI step (ms)':>14} {'ratio':>7}"
    )
    for r in rows:
        print(
            f"{r['num_silos']:>6} {r['units']:>7} {r['sfvi_round_ms']:>16.3f} "
            f"{r['svi_step_ms']:>14.3f} {r['ratio']:>7.2f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "jax": jax.__version__,
        "numpyro": numpyro.__version__,
        "machine": platform.machine(),
        "jax_devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
    }
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="SFVI round vs NumPyro SVI step")
    parser.add_argument("--num-silos", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--units-per-silo", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--out", default="benchmarks/results/sfvi_round.json")
    main(parser.parse_args())
