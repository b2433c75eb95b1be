# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Benchmark: the cost of a conducive gradient, and accuracy per second
===================================================================

1. **Step cost.** A logistic regression (20 features) split over J silos of 1,000
   rows. One FSGLD step (full and diagonal Gaussian surrogates) and one DSGLD step
   are timed against one plain SGLD step on a minibatch of the same size from the
   pooled data, written directly with NumPyro's ``log_density``; each runs 1,000 steps
   inside one jitted ``lax.scan`` and the steps are timed alternately, in the same
   process, keeping the fastest of the repeats (the least disturbed by other load).
   The ratio to SGLD is the result (target: <= 1.2).
2. **Error of the posterior mean vs wall time** on a 100k-row logistic regression
   with label-skewed silos: NUTS (pooled data), FSGLD and DSGLD (minibatches of 100,
   tau = 10) at several run lengths, each error in posterior sds of a long NUTS
   reference. Wall times include compilation and, for FSGLD, the Laplace surrogates.

Run: ``python benchmarks/fsgld_step.py`` (writes ``benchmarks/results/fsgld_step.json``;
``--quick`` for a short smoke run, ``--step-cost-only`` to redo part 1 and keep the
stored part 2).
"""

import argparse
import json
import os
from pathlib import Path
import platform
import time

from _timing import interleaved_times  # benchmarks/ is on sys.path
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS
from numpyro.infer.util import log_density

import numpyro_fed as nf


def model(X, y):
    beta = numpyro.sample("beta", dist.Normal(0, 2).expand([X.shape[-1]]).to_event(1))
    with nf.silo_plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ beta), obs=y)


def synthetic(num_rows, num_features, seed=0):
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(num_rows, num_features))
    beta = rng.normal(size=num_features) / np.sqrt(num_features)
    y = (rng.uniform(size=num_rows) < 1 / (1 + np.exp(-X @ beta))).astype(float)
    return X, y


def step_cost(num_silos, rows_per_silo=1000, batch=50, num_steps=1000, repeats=15):
    X, y = synthetic(num_silos * rows_per_silo, 20)
    groups = np.repeat(np.arange(num_silos), rows_per_silo)
    data = nf.FederatedData.from_groups(groups, X=X, y=y)
    n, h = len(y), 1e-5
    kernels = {
        "dsgld": nf.DSGLD(model, h, tau=10, batch_size=batch),
        "fsgld_full": nf.FSGLD(
            model, h, nf.fit_surrogates(model, data), 10, batch_size=batch
        ),
        "fsgld_diag": nf.FSGLD(
            model,
            h,
            nf.fit_surrogates(model, data, covariance="diag"),
            10,
            batch_size=batch,
        ),
    }
    Xp, yp = jnp.asarray(X), jnp.asarray(y)

    def sgld_scan(state):  # plain SGLD on the pooled data, one minibatch per step
        def body(carry, _):
            beta, key = carry
            key, k_batch, k_noise = jax.random.split(key, 3)
            idx = jax.random.randint(k_batch, (batch,), 0, n)

            def log_post(b):
                joint = log_density(model, (Xp[idx], yp[idx]), {}, {"beta": b})[0]
                prior = dist.Normal(0, 2).log_prob(b).sum()
                return prior + (joint - prior) * n / batch

            g = jax.grad(log_post)(beta)
            noise = jax.random.normal(k_noise, beta.shape)
            return (beta + 0.5 * h * g + jnp.sqrt(h) * noise, key), None

        return jax.lax.scan(body, state, None, length=num_steps)[0]

    fns, states = [jax.jit(sgld_scan)], [(jnp.zeros(20), jax.random.key(0))]
    for kernel in kernels.values():
        # The kernel's own step (one contact of the chain's silo), as MCMC runs it.
        start = {"beta": jnp.zeros(20)}
        states.append(kernel.init(jax.random.key(0), 0, start, (data,), {}))

        def scan(state, kernel=kernel):
            body = lambda s, _: (kernel.sample(s, (data,), {}), None)
            return jax.lax.scan(body, state, None, length=num_steps)[0]

        fns.append(jax.jit(scan))
    steps = [lambda state, fn=fn: (fn(state), None) for fn in fns]
    times = interleaved_times(steps, states, repeats, statistic=np.min)
    row = {
        "num_silos": num_silos,
        "batch": batch,
        "sgld_us": 1e6 * times[0] / num_steps,
    }
    for name, t in zip(kernels, times[1:], strict=True):
        row[f"{name}_us"] = 1e6 * t / num_steps
        row[f"{name}_ratio"] = t / times[0]
    return row


def accuracy_vs_time(num_rows, num_silos, lengths, seed=0):
    X, y = synthetic(num_rows, 10, seed)
    groups = nf.data.split_label_skew(y, num_silos, dominant=0.9, seed=seed)
    data = nf.FederatedData.from_groups(groups, X=X, y=y)
    pooled = data.pooled()
    start = time.perf_counter()
    ref = MCMC(NUTS(model), num_warmup=1000, num_samples=4000, progress_bar=False)
    ref.run(jax.random.key(100), **pooled)
    ref_seconds = time.perf_counter() - start
    draws = np.asarray(ref.get_samples()["beta"])
    ref_mean, ref_sd = draws.mean(0), draws.std(0)
    error = lambda s: float(np.max(np.abs(np.asarray(s).mean(0) - ref_mean) / ref_sd))
    rows = [{"method": "nuts_reference", "samples": 4000, "seconds": ref_seconds}]
    for num_samples in lengths["nuts"]:
        start = time.perf_counter()
        mcmc = MCMC(
            NUTS(model),
            num_warmup=num_samples,
            num_samples=num_samples,
            progress_bar=False,
        )
        mcmc.run(jax.random.key(seed), **pooled)
        beta = mcmc.get_samples()["beta"]
        rows.append(
            {
                "method": "nuts",
                "samples": num_samples,
                "seconds": time.perf_counter() - start,
                "error_sd": error(beta),
            }
        )
    start = time.perf_counter()
    q = nf.fit_surrogates(model, data)
    fit_seconds = time.perf_counter() - start
    h = 0.2 / num_rows  # h * (posterior curvature) ~ 0.2 at this scale
    for name in ("fsgld", "dsgld"):
        for num_samples in lengths["sgld"]:
            if name == "fsgld":
                kernel = nf.FSGLD(model, h, q, tau=10, batch_size=100)
            else:
                kernel = nf.DSGLD(model, h, tau=10, batch_size=100)
            start = time.perf_counter()
            mcmc = MCMC(
                kernel,
                num_warmup=num_samples // 4,
                num_samples=num_samples,
                progress_bar=False,
            )
            mcmc.run(jax.random.key(seed), data)
            beta = mcmc.get_samples()["beta"]
            seconds = (
                time.perf_counter() - start + (fit_seconds if name == "fsgld" else 0)
            )
            rows.append(
                {
                    "method": name,
                    "samples": num_samples,
                    "seconds": seconds,
                    "error_sd": error(beta),
                }
            )
    return rows, fit_seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--quick", action="store_true", help="short smoke run")
    parser.add_argument(
        "--step-cost-only",
        action="store_true",
        help="rerun the step cost only; keep the accuracy-vs-time rows stored in --out",
    )
    parser.add_argument("--repeats", type=int, default=15, help="timed repeats")
    parser.add_argument(
        "--out", default=str(Path(__file__).parent / "results" / "fsgld_step.json")
    )
    args = parser.parse_args()
    jax.config.update("jax_enable_x64", True)

    silos = (10,) if args.quick else (10, 100)
    costs = [step_cost(j, repeats=args.repeats) for j in silos]
    print(
        "\nStep cost (microseconds per step; ratio to plain SGLD on the same batch size)"
    )
    print(
        f"{'J':>5} {'SGLD':>8} {'DSGLD':>8} {'FSGLD full':>11} {'FSGLD diag':>11} "
        f"{'DSGLD/SGLD':>11} {'FSGLD/SGLD':>11} {'diag/SGLD':>10}"
    )
    for r in costs:
        print(
            f"{r['num_silos']:>5} {r['sgld_us']:>8.1f} {r['dsgld_us']:>8.1f} "
            f"{r['fsgld_full_us']:>11.1f} {r['fsgld_diag_us']:>11.1f} "
            f"{r['dsgld_ratio']:>11.2f} {r['fsgld_full_ratio']:>11.2f} "
            f"{r['fsgld_diag_ratio']:>10.2f}"
        )

    meta = {
        "jax": jax.__version__,
        "numpyro": numpyro.__version__,
        "machine": platform.machine(),
        "jax_devices": jax.local_device_count(),
        "cpu_count": os.cpu_count(),
        "x64": True,
        "quick": args.quick,
        "repeats": args.repeats,
    }
    if args.step_cost_only:
        path = Path(args.out)
        out = json.loads(path.read_text()) if path.exists() else {}
        out["step_cost"], out["step_cost_meta"] = costs, meta
        path.parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(f"\nupdated the step cost in {args.out}")
        return

    if args.quick:
        lengths, rows_n = {"nuts": [100], "sgld": [2000]}, 20_000
    else:
        lengths, rows_n = {"nuts": [100, 400], "sgld": [2000, 10000, 40000]}, 100_000
    accuracy, fit_seconds = accuracy_vs_time(rows_n, 20, lengths)
    print(
        f"\nPosterior-mean error vs wall time ({rows_n} rows, 20 label-skewed silos; "
        f"error = max |mean - NUTS ref| in reference sds; FSGLD includes the "
        f"{fit_seconds:.1f} s Laplace fit)"
    )
    print(f"{'method':>15} {'samples':>8} {'seconds':>8} {'error (sd)':>11}")
    for r in accuracy:
        err = f"{r['error_sd']:>11.3f}" if "error_sd" in r else f"{'(reference)':>11}"
        print(f"{r['method']:>15} {r['samples']:>8} {r['seconds']:>8.1f} {err}")

    out = {"meta": meta, "step_cost": costs, "accuracy_vs_time": accuracy}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
