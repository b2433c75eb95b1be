# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Benchmark: one SFVI round vs one centralized NumPyro SVI step
=============================================================

A synthetic logistic GLMM (a random intercept per child, 4 visits, 4 covariates) with
``units_per_silo`` children in each of J silos. For J in (10, 100, 1000) it times one
simulated SFVI round (all silos vmapped, the round jitted; with the replies summed in
one pull-back, the default, and one reply per silo) and one step of NumPyro's ``SVI``
on the pooled data, in the same process, and reports their ratios: one call at a time
(dispatch included) and inside one compiled ``lax.scan`` of ``--scan-length`` steps
(pure compute). Two guides: the default ``AutoGlobalLocalNormal`` on both sides
(``structured``), and its mean-field form (``global_cov="diag"``, no coupling) against
NumPyro's ``AutoNormal`` (``mean-field``). Wall-clock times are machine-dependent and,
on a shared machine, load-dependent (the load average is recorded); the ratios are the
result, with XLA's count of floating-point operations (load-independent) beside them.

Run: ``python benchmarks/sfvi_round.py`` (writes ``benchmarks/results/sfvi_round.json``).
"""

import argparse
import json
import os
from pathlib import Path

from _timing import interleaved_times, machine_meta  # benchmarks/ is on sys.path
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import SVI, Trace_ELBO
from numpyro.infer.autoguide import AutoNormal
import optax

import numpyro_fed as nf
from numpyro_fed.elbo import noise_keys
from numpyro_fed.protocol import silo_data_of
from numpyro_fed.runtime import simulate_round


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


def scanned(step, length):
    """``length`` steps inside one compiled ``lax.scan``: pure compute, no dispatch."""

    def many(state):
        state, outs = jax.lax.scan(lambda s, _: step(s), state, None, length=length)
        return state, outs

    return jax.jit(many)


def flops(step, state):
    """XLA's count of floating-point operations of one compiled ``step(state)`` (a
    conditional counts as its costlier branch: on CPU the summed round's count holds
    its units-end-to-end path and the silo-by-silo path it falls back to when a sum
    is not finite)."""
    cost = jax.jit(step).lower(state).compile().cost_analysis()
    return float((cost[0] if isinstance(cost, list) else cost)["flops"])


GUIDES = {
    # name: (federated guide, centralized guide)
    "structured": (nf.AutoGlobalLocalNormal, nf.AutoGlobalLocalNormal),
    "mean-field": (
        lambda m: nf.AutoGlobalLocalNormal(m, global_cov="diag", coupling=False),
        AutoNormal,
    ),
}


def bench(num_silos, units_per_silo, repeats, scan_length, guide="structured"):
    X, y = synthetic(num_silos * units_per_silo)
    groups = np.repeat(np.arange(num_silos), units_per_silo)
    data = nf.FederatedData.from_groups(groups, X=X, y=y)
    fed = nf.federate(model, silos="child")
    federated_guide, centralized_guide = GUIDES[guide]

    sfvi = nf.SFVI(fed, federated_guide(fed), optax.adam(1e-2))
    state = sfvi.init(jax.random.key(0), data)
    # The round as the runtime runs it, once with the silos' replies summed in one
    # pull-back (the default) and once one reply per silo, with fixed keys.
    summed = sfvi.federation(data).algorithm
    per_silo = summed._replace(reduce_silos=None)
    silo_data = silo_data_of(data)
    server_key = noise_keys(jax.random.key(1), 1)
    silo_keys = jnp.broadcast_to(server_key, (num_silos,) + server_key.shape)

    def round_of(algorithm):
        def step(states):
            server, silos, info = simulate_round(
                algorithm, *states, silo_data, server_key, silo_keys
            )
            return (server, silos), info.loss

        return step

    pooled = data.pooled()
    svi = SVI(fed, centralized_guide(fed), optax.adam(1e-2), Trace_ELBO())
    svi_state = svi.init(jax.random.key(0), **pooled)
    svi_step = lambda s: svi.update(s, **pooled)  # noqa: E731
    steps = [round_of(summed), round_of(per_silo), svi_step]
    states = [(state.server, state.silos)] * 2 + [svi_state]
    one = interleaved_times([jax.jit(f) for f in steps], states, repeats)
    many = interleaved_times(
        [scanned(f, scan_length) for f in steps],
        states,
        repeats,
    )
    many = [t / scan_length for t in many]
    load = os.getloadavg()[0]
    row = {"guide": guide, "num_silos": num_silos, "units": num_silos * units_per_silo}
    f_sum, f_each, f_svi = (flops(f, s) for f, s in zip(steps, states, strict=True))
    row["flops_ratio"] = f_sum / f_svi
    row["per_silo_flops_ratio"] = f_each / f_svi
    row["load_average"] = load
    for mode, (t_sum, t_each, t_svi) in (("call", one), ("scan", many)):
        row[f"{mode}_svi_step_ms"] = 1e3 * t_svi
        row[f"{mode}_sfvi_round_ms"] = 1e3 * t_sum
        row[f"{mode}_ratio"] = t_sum / t_svi
        row[f"{mode}_per_silo_ratio"] = t_each / t_svi
    return row


def main(args):
    rows = [
        bench(j, args.units_per_silo, args.repeats, args.scan_length, guide)
        for guide in args.guides
        for j in args.num_silos
    ]
    print("SFVI round / NumPyro SVI step; 'summed': the default simulated round")
    print("(replies summed in one pull-back), 'per silo': one reply per silo;")
    print("'flops': XLA's count, summed round (with its fallback branch) / SVI step;")
    print("'load': 1-minute average")
    print(
        f"{'guide':>10} {'J':>6} {'SVI step ms':>12} {'summed':>7} {'per silo':>9} "
        f"{'scan: summed':>13} {'per silo':>9} {'flops':>6} {'load':>5}"
    )
    for r in rows:
        print(
            f"{r['guide']:>10} {r['num_silos']:>6} {r['call_svi_step_ms']:>12.3f} "
            f"{r['call_ratio']:>7.2f} {r['call_per_silo_ratio']:>9.2f} "
            f"{r['scan_ratio']:>13.2f} {r['scan_per_silo_ratio']:>9.2f} "
            f"{r['flops_ratio']:>6.2f} {r['load_average']:>5.1f}"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        **machine_meta(),
    }
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="SFVI round vs NumPyro SVI step")
    parser.add_argument("--num-silos", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--units-per-silo", type=int, default=5)
    parser.add_argument(
        "--guides", nargs="+", choices=sorted(GUIDES), default=sorted(GUIDES)
    )
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--scan-length", type=int, default=20)
    parser.add_argument("--out", default="benchmarks/results/sfvi_round.json")
    main(parser.parse_args())
