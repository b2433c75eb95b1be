# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Benchmark: does the VI classes' default optimizer converge?
===========================================================

Centralized NumPyro SVI with ``AutoMultivariateNormal`` on a reference posterior of
:mod:`numpyro_fed.reference` (pooled data, one particle, ``Trace_ELBO``: SFVI with
``stl=False`` is the same fit iterate for iterate), once per learning-rate rule and
seed. Prints, at checkpoints, the worst distance of a global site's median from the
family's optimum (a 40,000-step, 16-particle fit with a rate halved every 4,000
steps) over the seeds, in reference posterior sds. The rules: Adam at a constant
0.01; :func:`numpyro_fed.infer.optim.default_optimizer` (0.01, then 1/t after 1,000
steps); 0.01, then 1/sqrt(t) after 1,000 steps. Float64.

Run: ``python benchmarks/default_schedule.py --posterior eight_schools_noncentered``
"""

import argparse
import json
from pathlib import Path
import time

import jax

jax.config.update("jax_enable_x64", True)

from _timing import machine_meta  # noqa: E402  (benchmarks/ is on sys.path)
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from numpyro.infer import SVI, Trace_ELBO  # noqa: E402
from numpyro.infer.autoguide import AutoMultivariateNormal  # noqa: E402
import optax  # noqa: E402

from numpyro_fed import reference  # noqa: E402
from numpyro_fed.infer.optim import default_optimizer  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def fit(post, opt, seed, checks, particles=1):
    """The guide's medians of the global sites at each of ``checks`` steps."""
    pooled = post.data.pooled()
    guide = AutoMultivariateNormal(post.model)
    svi = SVI(post.model, guide, opt, Trace_ELBO(num_particles=particles))
    state = svi.init(jax.random.key(seed), **pooled)

    def steps(state, n):
        return jax.lax.fori_loop(0, n, lambda i, s: svi.update(s, **pooled)[0], state)

    run = jax.jit(steps, static_argnums=1)
    out, done = {}, 0
    for c in checks:
        state = run(state, c - done)
        done = c
        median = guide.median(svi.get_params(state))
        out[c] = {k: np.asarray(median[k]) for k in post.reference}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--posterior", default="eight_schools_noncentered")
    p.add_argument(
        "--checks", type=int, nargs="+", default=[2000, 4000, 8000, 16000, 32000]
    )
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--out", type=Path, default=RESULTS / "default_schedule.json")
    args = p.parse_args(argv)
    post = reference.load(args.posterior)
    sd = {k: np.asarray(v.sd) for k, v in post.reference.items()}
    start = time.perf_counter()
    optimum_opt = optax.adam(optax.exponential_decay(1e-2, 4000, 0.5))
    optimum = fit(post, optimum_opt, 0, [40000], particles=16)[40000]
    rules = {
        "Adam 0.01, constant": optax.adam(1e-2),
        "default (1/t after 1,000)": default_optimizer(),
        "1/sqrt(t) after 1,000": optax.adam(
            lambda t: 1e-2 * jnp.minimum(1.0, jnp.sqrt(1000.0 / (t + 1.0)))
        ),
    }
    table = {}
    print(f"{args.posterior}: worst |median - optimum| / reference sd")
    print(f"{'rule':28s}" + "".join(f"{c:>9d}" for c in args.checks))
    for label, opt in rules.items():
        runs = [fit(post, opt, s + 1, args.checks) for s in range(args.seeds)]
        table[label] = {
            c: max(
                float(np.max(np.abs(r[c][k] - optimum[k]) / sd[k]))
                for r in runs
                for k in sd
            )
            for c in args.checks
        }
        print(f"{label:28s}" + "".join(f"{table[label][c]:9.3f}" for c in args.checks))
    record = {
        "posterior": args.posterior,
        "seeds": args.seeds,
        "table": table,
        "seconds": time.perf_counter() - start,
        "machine": machine_meta(),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
