# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Example: Federating an existing NumPyro model (six-cities GLMM)
===============================================================

The six-cities wheeze study (537 children, 4 visits each) with a logistic mixed model:
a random intercept per child and four fixed effects (Hassan et al., Supplement S3.1).
The children are split between two hospitals of 300 and 237 children; the model is
not edited: ``nf.federate(model, silos="child")`` says that the "child" plate runs
over silos. SFVI fits the structured Gaussian guide without pooling the data, and the
result is compared with NUTS on the pooled data.

Run: ``python examples/quickstart.py`` (about a minute on 2 CPU cores); ``--quick``
for a smoke run with few steps and draws (seconds; too short to agree with NUTS).
"""

import argparse
from pathlib import Path
import time

import jax
import jax.numpy as jnp
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS
import optax

import numpyro_fed as nf
from numpyro_fed.datasets import six_cities


def model(X, y=None):
    """An ordinary NumPyro model, as one would write it for NUTS."""
    beta = numpyro.sample("beta", dist.Normal(0, 10).expand([X.shape[-1]]).to_event(1))
    omega = numpyro.sample("omega", dist.Normal(0, 10))
    with numpyro.plate("child", X.shape[0], dim=-2):
        b = numpyro.sample("b", dist.Normal(0, jnp.exp(-omega)))
        with numpyro.plate("visit", X.shape[1], dim=-1):
            numpyro.sample("y", dist.Bernoulli(logits=X @ beta + b), obs=y)


def main(args):
    numpyro.enable_x64()
    cities = six_cities()
    # Two hospitals of 300 and 237 children, assigned at random.
    hospital = nf.data.split_iid(len(cities.y), 2, sizes=[300, 237], seed=args.seed)
    data = nf.FederatedData.from_groups(hospital, X=cities.X, y=cities.y)
    print(data)

    fed = nf.federate(model, silos="child")
    schedule = optax.exponential_decay(args.lr, args.num_steps // 3, 0.5)
    svi = nf.SFVI(
        fed,
        nf.AutoGlobalLocalNormal(fed),
        optax.adam(schedule),
        num_particles=args.num_particles,
    )
    start = time.perf_counter()
    result = svi.run(
        jax.random.key(args.seed),
        args.num_steps,
        data,
        progress_bar=not args.no_progress,
    )
    print(
        f"SFVI: {args.num_steps} rounds in {time.perf_counter() - start:.1f}s, "
        f"final loss {float(result.losses[-100:].mean()):.2f}"
    )
    posterior = svi.sample_posterior(
        jax.random.key(1), result.params, data, num_samples=args.num_samples
    )

    start = time.perf_counter()
    mcmc = MCMC(
        NUTS(model),
        num_warmup=args.num_warmup,
        num_samples=args.num_samples,
        progress_bar=not args.no_progress,
    )
    mcmc.run(jax.random.key(2), **data.pooled())
    print(f"NUTS on the pooled data: {time.perf_counter() - start:.1f}s")

    table = nf.compare(
        posterior, mcmc, var_names=["beta", "omega"], labels=("sfvi", "nuts")
    )
    print(nf.format_compare(table))

    if args.plot:
        import arviz as az
        import matplotlib

        matplotlib.use("Agg")
        out = Path(args.plot)
        out.parent.mkdir(parents=True, exist_ok=True)
        plot = az.plot_forest(
            {
                "SFVI (2 silos)": nf.to_arviz(posterior),
                "NUTS (pooled)": nf.to_arviz(mcmc),
            },
            var_names=["beta", "omega"],
        )
        plot.add_legend("model")
        plot.savefig(out)
        print(f"forest plot saved to {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--num-steps", type=int, default=6000)
    parser.add_argument("--num-particles", type=int, default=4)
    parser.add_argument("--lr", type=float, default=0.02)
    parser.add_argument("--num-warmup", type=int, default=1000)
    parser.add_argument("--num-samples", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plot", default="examples/output/six_cities_forest.png")
    parser.add_argument("--no-progress", action="store_true")
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    args = parser.parse_args()
    if args.quick:
        args.num_steps, args.num_warmup, args.num_samples = 300, 200, 300
    main(args)
