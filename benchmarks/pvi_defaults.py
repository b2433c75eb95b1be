# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Benchmark: PVI's defaults against the same family fitted centrally
==================================================================

For reference posteriors of :mod:`numpyro_fed.reference`, runs ``nf.PVI`` (default
``AutoMeanField``; options from the command line) and centralized NumPyro SVI with
``AutoNormal`` (the same mean-field family) on the pooled data: Adam with an
exponentially decaying rate, ``--svi-steps`` steps, 16 particles, the parameters
averaged over the last quarter of the steps. Prints, per posterior, the largest
``|mean_PVI - mean_SVI|`` over the global coordinates in reference sds, the range of
``sd_PVI / sd_SVI``, the same two against the published reference, and the number of
rounds after which PVI stays within 0.1 reference sd of SVI (checked every
``--every`` rounds). Float64; 8,000 draws from each.

Run: ``python benchmarks/pvi_defaults.py --posteriors german_credit_numeric_logistic_regression``
"""

import argparse
import json
from pathlib import Path
import time

import jax

jax.config.update("jax_enable_x64", True)

import numpy as np  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoNormal  # noqa: E402
import optax  # noqa: E402

import numpyro_fed as nf  # noqa: E402
from numpyro_fed import reference  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "reference"
_DRAWS = 8000


def central(post, steps, key):
    """Means and sds of the global sites under centralized mean-field SVI."""
    guide = AutoNormal(post.model)
    optim = optax.adam(optax.exponential_decay(1e-2, steps // 4, 0.5))
    svi = SVI(post.model, guide, optim, Trace_ELBO(num_particles=16))
    pooled = post.data.pooled()
    state = svi.init(key, **pooled)
    step = jax.jit(lambda s: svi.update(s, **pooled)[0])
    tail = []
    for i in range(steps):
        state = step(state)
        if i >= 3 * steps // 4 and i % 10 == 0:
            tail.append(svi.get_params(state))
    params = jax.tree.map(lambda *x: np.mean(np.stack(x), 0), *tail)
    draws = guide.sample_posterior(
        jax.random.fold_in(key, 1), params, sample_shape=(_DRAWS,)
    )
    return {
        k: (np.asarray(draws[k]).mean(0), np.asarray(draws[k]).std(0))
        for k in post.reference
    }


def moments(fit, state, post, key):
    params = fit.get_params(state)
    draws = fit.sample_posterior(key, params, post.data, num_samples=_DRAWS)
    return {
        k: (np.asarray(draws[k]).mean(0), np.asarray(draws[k]).std(0))
        for k in post.reference
    }


def compare(got, target, post):
    err, lo, hi = 0.0, np.inf, 0.0
    for k, ref in post.reference.items():
        err = max(err, float(np.max(np.abs(got[k][0] - target[k][0]) / ref.sd)))
        ratio = got[k][1] / target[k][1]
        lo, hi = min(lo, float(np.min(ratio))), max(hi, float(np.max(ratio)))
    return err, lo, hi


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--posteriors", nargs="+", default=list(reference.names()))
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--every", type=int, default=10)
    p.add_argument("--svi-steps", type=int, default=20000)
    p.add_argument("--options", default="{}", help="PVI keyword arguments (JSON)")
    p.add_argument("--cache", type=Path, default=RESULTS / "central_mf.json")
    args = p.parse_args(argv)
    options = json.loads(args.options)
    cache = json.loads(args.cache.read_text()) if args.cache.exists() else {}
    for name in args.posteriors:
        post = reference.load(name)
        if name not in cache:
            start = time.perf_counter()
            c = central(post, args.svi_steps, jax.random.key(1))
            cache[name] = {k: [v[0].tolist(), v[1].tolist()] for k, v in c.items()}
            args.cache.write_text(json.dumps(cache, indent=1))
            print(
                f"{name}: central SVI {time.perf_counter() - start:.0f} s", flush=True
            )
        target = {
            k: (np.asarray(m), np.asarray(s)) for k, (m, s) in cache[name].items()
        }
        ref = {k: (r.mean, r.sd) for k, r in post.reference.items()}
        fit = nf.PVI(post.fed_model, **options)
        state = fit.init(jax.random.key(0), post.data)
        start, converged, done = time.perf_counter(), None, 0
        while done < args.rounds:
            try:
                result = fit.run(
                    jax.random.key(done),
                    args.every,
                    post.data,
                    init_state=state,
                    progress_bar=False,
                )
            except Exception as e:  # noqa: BLE001  (reported in the table)
                print(f"{name}: round {done}: {type(e).__name__}: {e}", flush=True)
                break
            state, done = result.state, done + args.every
            got = moments(fit, state, post, jax.random.key(7))
            err, lo, hi = compare(got, target, post)
            rerr, rlo, rhi = compare(got, ref, post)
            if err <= 0.1 and converged is None:
                converged = done
            elif err > 0.1:
                converged = None
            print(
                f"{name} round {done:4d}: vs SVI {err:7.3f} sd, ratio {lo:.2f}-{hi:.2f}"
                f" | vs ref {rerr:7.3f} sd, ratio {rlo:.2f}-{rhi:.2f}"
                f" | loss {float(np.mean(result.losses[-3:])):.2f}"
                f" | {time.perf_counter() - start:.0f} s",
                flush=True,
            )
        c_err, c_lo, c_hi = compare(target, ref, post)
        print(
            f"{name}: central SVI vs ref {c_err:.3f} sd, ratio {c_lo:.2f}-{c_hi:.2f};"
            f" PVI within 0.1 sd of SVI from round {converged}",
            flush=True,
        )


if __name__ == "__main__":
    main()
