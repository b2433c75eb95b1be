# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Benchmark: wall time to NUTS accuracy, every federated algorithm against NUTS
============================================================================

Two problems:

- **logistic**: a logistic regression with ``--rows`` rows (default 1,000,000), an
  intercept and 9 standard-normal features, ``Normal(0, 2)`` priors on the 10
  coefficients, split IID over ``--silos`` silos (default 100);
- **six_cities**: the six-cities GLMM of ``examples/quickstart.py`` (537 children, a
  random intercept each, globals ``beta`` (4) and ``omega``), split between two
  hospitals of 300 and 237 children as in ``examples/six_cities_methods.py``.

NUTS on the pooled data (``--nuts-warmup`` 500 + ``--nuts-samples`` 1,000 draws, one
chain) is the reference: its posterior means and sds define the target, and its wall
time (compilation included) is the time NUTS takes to get there. Then every
algorithm, ``nf.SFVI``, ``nf.SFVIAvg``, ``nf.PVI``, ``nf.FSGLD`` and ``nf.DSGLD``, runs
in chunks; after each chunk the distance

    max over global coordinates of |mean - NUTS mean| / NUTS sd

is checked, and the algorithm stops at the first chunk within ``--target`` (0.1)
or once its wall time passes ``--budget`` seconds ("not reached in B s"). Wall
time counts everything from building the algorithm on: ``init``, every compilation,
every chunk, FSGLD's surrogate fit (``nf.fit_surrogates``), and the checks. The
result is the time of each algorithm and the ratio best federated / NUTS.

The means compared: for SFVI and SFVI-Avg the average of the chunk-end ``loc``s of
the global Gaussian over the later half of the chunks so far (both problems' global
sites are unconstrained, so ``loc`` is the mean); for PVI the last ``loc``; for FSGLD
and DSGLD the running mean of every draw after a burn-in chunk.

Settings. Library defaults wherever they exist (the guide ``AutoGlobalLocalNormal`` for
SFVI and SFVI-Avg, one particle; PVI with its default guide, solver, damping and
local steps; FSGLD's whole-silo gradients and ``tau = 1``). What the libraries leave
to the user is set by one rule for both problems, never tuned per run:

- SFVI and SFVI-Avg: Adam at a constant 0.01 (an SFVI round is one step, an SFVI-Avg
  round ``local_steps`` = 10 steps per silo), the iterates averaged as above. (A
  rate halved every 1,000 steps froze the six-cities fits 4.6-4.8 sd off, where
  their optimum is 1.2 sd off; centralized NumPyro SVI with ``AutoNormal`` and that
  schedule froze 6.5 sd off, at a slower one 1.3 sd.)
- FSGLD: surrogates ``nf.fit_surrogates(model, data, prior_power=1 / J)`` (Laplace,
  full; ``prior_power = f_s = 1/J`` as ``docs/fsgld.md`` advises), fitted inside the
  timed call; the chain starts at the mean of their product ``prod_s q_s`` (each
  holds ``1/J`` of the prior: a Gaussian approximation of the posterior) with step
  size ``h = 0.2 / lambda_max`` of the product's precision (on a Gaussian target
  with that precision, the unadjusted Langevin chain's stationary variance is then
  at most ``1 / (1 - 0.1)`` of the target's in any direction, and its mean exact);
- DSGLD: step size ``h = 0.2 / N`` with ``N`` the number of observations (h times the
  per-observation curvature of a logistic likelihood, about 0.2, is then O(1/N) of
  the posterior's), ``tau = 10``, minibatches of ``min(100, smallest silo)`` units.

The first Langevin chunk is burn-in and is discarded.

Chunks: ``--sfvi-chunk`` SFVI rounds, ``--avg-chunk`` SFVI-Avg rounds,
``--pvi-chunk`` PVI rounds, ``--fsgld-chunk`` FSGLD and ``--sgld-chunk`` DSGLD steps. The time to accuracy
is measured at chunk ends, so it is resolved to one chunk. Float64 throughout.

The Langevin chunks run the kernels' own ``sample`` in one jitted ``lax.scan`` per
chunk (compiled once, the running sum carried inside). ``--sgld-loop mcmc`` runs
them the NumPyro way instead, ``MCMC.run`` continued with ``mcmc.post_warmup_state =
mcmc.last_state``: NumPyro 0.22 recompiles its sampling loop on every such call
(``fori_collect`` jits a fresh wrapper of its body each time; about 1.4 s per
chunk at 20k rows on 2 busy cores, against 5-10 us per step), which then dominates
the time.

Wall-clock times depend on the machine and on its load; say which when quoting them
(the JSON records the 1/5/15-minute load averages at the start and the end).
``--reference FILE`` reuses the NUTS mean, sd and time of an earlier JSON of the same
problem and size instead of running NUTS (for exploring; not for recorded results).

Run: ``python benchmarks/time_to_accuracy.py --rows 100000`` (writes
``benchmarks/results/time_to_accuracy.json``; ``--problems logistic`` or
``six_cities`` for one problem).
"""

import argparse
import json
import os
from pathlib import Path
import time

from _timing import machine_meta  # benchmarks/ is on sys.path
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS, init_to_value
import optax
from sfvi_round import model as glmm  # the six-cities GLMM with vague priors

import numpyro_fed as nf
from numpyro_fed.datasets import six_cities
from numpyro_fed.expfam import GaussianNat, to_moments


def logistic(X, y):
    beta = numpyro.sample("beta", dist.Normal(0, 2).expand([X.shape[-1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ beta), obs=y)


def logistic_problem(num_rows, num_silos, seed):
    rng = np.random.default_rng(seed)
    X = np.concatenate([np.ones((num_rows, 1)), rng.normal(size=(num_rows, 9))], 1)
    beta = rng.normal(size=10) / np.sqrt(10)
    y = (rng.uniform(size=num_rows) < 1 / (1 + np.exp(-X @ beta))).astype(float)
    groups = nf.data.split_iid(num_rows, num_silos, seed=seed)
    data = nf.FederatedData.from_groups(groups, X=X, y=y)
    return logistic, nf.federate(logistic, silos="data"), data, num_rows


def six_cities_problem(seed):
    cities = six_cities()
    hospital = nf.data.split_iid(len(cities.y), 2, sizes=[300, 237], seed=seed)
    data = nf.FederatedData.from_groups(hospital, X=cities.X, y=cities.y)
    return glmm, nf.federate(glmm, silos="child"), data, cities.y.size


def flat(values, names, xp=np):
    """The global sites' values in ``names`` order, flattened."""
    return xp.concatenate([xp.reshape(values[n], (-1,)) for n in names])


def flat_draws(draws, names):
    return np.concatenate(
        [np.asarray(draws[n]).reshape(len(draws[n]), -1) for n in names], axis=1
    )


def run_nuts(model, data, args):
    start = time.perf_counter()
    mcmc = MCMC(
        NUTS(model),
        num_warmup=args.nuts_warmup,
        num_samples=args.nuts_samples,
        progress_bar=False,
    )
    mcmc.run(jax.random.key(args.seed + 1), **data.pooled())
    samples = mcmc.get_samples()
    jax.block_until_ready(samples)
    return time.perf_counter() - start, samples


class Tracker:
    """Distance to NUTS after each chunk, the clock, and the stopping rule."""

    def __init__(self, ref_mean, ref_sd, target, budget):
        self.ref_mean, self.ref_sd = ref_mean, ref_sd
        self.target, self.budget = target, budget
        self.start = time.perf_counter()
        self.trace = []

    def check(self, mean, iterations):
        """Record the distance at ``mean``; True when the run should stop."""
        mean = np.asarray(mean)
        distance = float(np.max(np.abs(mean - self.ref_mean) / self.ref_sd))
        seconds = time.perf_counter() - self.start
        self.trace.append(
            {"seconds": seconds, "iterations": iterations, "distance": distance}
        )
        self.mean = mean.tolist()
        return distance <= self.target or seconds >= self.budget

    def thinned_trace(self):
        """At most ~100 checks: every k-th, and the last."""
        kept = self.trace[:: -(-len(self.trace) // 100)]
        return kept if kept[-1] is self.trace[-1] else kept + self.trace[-1:]

    def result(self, name, unit):
        last = self.trace[-1]
        reached = last["distance"] <= self.target
        return {
            "algorithm": name,
            "reached": reached,
            "seconds": last["seconds"],
            "iterations": last["iterations"],
            "unit": unit,
            "distance": last["distance"],
            "best_distance": min(t["distance"] for t in self.trace),
            "mean": self.mean,  # at the last check
            "trace": self.thinned_trace(),
        }


def run_vi(name, driver, data, names, tracker, chunk, seed):
    """SFVI / SFVI-Avg / PVI in chunks of ``chunk`` rounds via ``run(init_state=)``.
    ``average=True``: the mean compared is the average of the chunk-end ``loc``s over
    the later half of the chunks so far (a constant rate's iterates wander about the
    optimum; their average does not)."""
    guide = driver.guide
    state = driver.init(jax.random.key(seed), data)
    done, ends = 0, []
    while True:
        fit = driver.run(None, chunk, data, progress_bar=False, init_state=state)
        state, done = fit.state, done + chunk
        values, _ = guide.constrain_global(fit.params.eta_global["loc"])
        ends.append(flat(values, names))
        mean = np.mean(ends[len(ends) // 2 :], 0) if average_vi(driver) else ends[-1]
        if tracker.check(mean, done):
            return tracker.result(name, "rounds")


def average_vi(driver):
    """Whether the VI means are averaged over the later half of the chunk ends: for the
    stochastic-gradient fits (SFVI, SFVI-Avg), not for PVI's fixed-point iteration."""
    return not isinstance(driver, nf.PVI)


def run_sgld(name, kernel, data, names, tracker, chunk, seed, loop):
    """FSGLD / DSGLD: a burn-in chunk, then chunks continued from the last state;
    the running mean of every kept draw. ``loop="scan"``: ``kernel.sample`` in one
    jitted ``lax.scan`` per chunk, compiled once; ``"mcmc"``: ``MCMC.run`` continued
    with ``post_warmup_state`` (NumPyro recompiles its loop on every call)."""
    if loop == "mcmc":
        mcmc = MCMC(kernel, num_warmup=chunk, num_samples=chunk, progress_bar=False)
        mcmc.run(jax.random.key(seed), data)
        total, count, done = 0.0, 0, 2 * chunk
        while True:
            draws = flat_draws(mcmc.get_samples(), names)
            total, count = total + draws.sum(0), count + len(draws)
            if tracker.check(total / count, done):
                return tracker.result(name, "steps")
            mcmc.post_warmup_state = mcmc.last_state
            mcmc.run(mcmc.post_warmup_state.rng_key, data)
            done += chunk

    constrain = kernel.postprocess_fn((data,), {})

    def body(carry, _):
        state, total = carry
        state = kernel.sample(state, (data,), {})
        values = constrain(state.z)
        return (state, total + flat(values, names, jnp)), None

    @jax.jit
    def scan(state, total):
        return jax.lax.scan(body, (state, total), None, length=chunk)[0]

    state = kernel.init(jax.random.key(seed), chunk, None, (data,), {})
    zero = jnp.zeros(len(tracker.ref_mean))
    state, _ = scan(state, zero)  # burn-in, discarded
    total, done = zero, chunk
    while True:
        state, total = scan(state, total)
        done += chunk
        if tracker.check(total / (done - chunk), done):
            return tracker.result(name, "steps")


def adam():
    return optax.adam(1e-2)


def surrogate_start(q, names, shapes):
    """FSGLD's start and step size from its surrogates: the mean of their product
    ``prod_s q_s`` (each ``q_s`` holds ``1/J`` of the prior, so the product is a
    Gaussian approximation of the whole posterior) as ``init_to_value`` site values,
    and ``h = 0.2 / lambda_max`` of the product's precision."""
    total = GaussianNat(q.h.sum(0), q.prec.sum(0))
    mean = np.asarray(to_moments(total)[0])
    prec = np.asarray(total.prec)
    top = np.linalg.eigvalsh(prec)[-1] if prec.ndim == 2 else prec.max()
    if list(names) != sorted(names):  # q follows ravel_pytree's (sorted) site order
        raise ValueError(f"surrogate_start needs the site names sorted, got {names}.")
    sizes = np.cumsum([int(np.prod(shapes[n])) for n in names])[:-1]
    parts = np.split(mean, sizes)
    values = {n: jnp.reshape(v, shapes[n]) for n, v in zip(names, parts, strict=True)}
    return init_to_value(values=values), 0.2 / float(top)


def fsgld(fed, data, names, shapes):
    """FSGLD by the surrogate rule (:func:`surrogate_start`), library defaults
    otherwise (whole-silo gradients, ``tau = 1``); the fit is timed with the run."""
    q = nf.fit_surrogates(fed, data, prior_power=1 / data.num_silos, progress_bar=False)
    init, h = surrogate_start(q, names, shapes)
    return nf.FSGLD(fed, h, q, init_strategy=init)


def bench(problem, args):
    if problem == "logistic":
        model, fed, data, num_obs = logistic_problem(args.rows, args.silos, args.seed)
    else:
        model, fed, data, num_obs = six_cities_problem(args.seed)
    names = ["beta"] if problem == "logistic" else ["beta", "omega"]
    print(f"\n{problem}: {data.num_units} units, {data.num_silos} silos", flush=True)
    if args.reference:  # exploring: the NUTS reference of an earlier run
        ref = next(
            r
            for r in json.loads(Path(args.reference).read_text())["results"]
            if r["problem"] == problem and r["units"] == data.num_units
        )
        nuts_seconds, ref_mean, ref_sd = (
            ref["nuts_seconds"],
            np.asarray(ref["nuts_mean"]),
            np.asarray(ref["nuts_sd"]),
        )
        shapes = {"beta": (len(ref_mean) - (problem != "logistic"),), "omega": ()}
    else:
        nuts_seconds, samples = run_nuts(model, data, args)
        draws = flat_draws(samples, names)
        ref_mean, ref_sd = draws.mean(0), draws.std(0)
        shapes = {n: np.shape(samples[n])[1:] for n in names}
    print(f"  NUTS: {nuts_seconds:.1f} s", flush=True)

    def tracker():
        return Tracker(ref_mean, ref_sd, args.target, args.budget)

    h = 0.2 / num_obs
    batch = min(100, min(data.sizes))
    runs = {
        "SFVI": lambda t: run_vi(
            "SFVI",
            nf.SFVI(fed, nf.AutoGlobalLocalNormal(fed), adam()),
            data,
            names,
            t,
            args.sfvi_chunk,
            args.seed,
        ),
        "SFVIAvg": lambda t: run_vi(
            "SFVIAvg",
            nf.SFVIAvg(fed, nf.AutoGlobalLocalNormal(fed), adam(), local_steps=10),
            data,
            names,
            t,
            args.avg_chunk,
            args.seed,
        ),
        "PVI": lambda t: run_vi(
            "PVI", nf.PVI(fed), data, names, t, args.pvi_chunk, args.seed
        ),
        # The surrogates are fitted inside the timed call: FSGLD pays for them.
        "FSGLD": lambda t: run_sgld(
            "FSGLD",
            fsgld(fed, data, names, shapes),
            data,
            names,
            t,
            args.fsgld_chunk,
            args.seed,
            args.sgld_loop,
        ),
        "DSGLD": lambda t: run_sgld(
            "DSGLD",
            nf.DSGLD(fed, h, tau=10, batch_size=batch),
            data,
            names,
            t,
            args.sgld_chunk,
            args.seed,
            args.sgld_loop,
        ),
    }
    rows = []
    for name in args.algorithms:
        try:
            row = runs[name](tracker())
        except Exception as err:  # reported in the table, not hidden
            row = {"algorithm": name, "reached": False, "error": repr(err)}
            rows.append(row)
            print(f"  {name}: failed: {err!r}", flush=True)
            continue
        rows.append(row)
        print(f"  {name}: {describe(row, args.budget)}", flush=True)
    reached = [r["seconds"] for r in rows if r["reached"]]
    return {
        "problem": problem,
        "units": data.num_units,
        "observations": num_obs,
        "num_silos": data.num_silos,
        "nuts_seconds": nuts_seconds,
        "nuts_mean": ref_mean.tolist(),
        "nuts_sd": ref_sd.tolist(),
        "best_federated_over_nuts": min(reached) / nuts_seconds if reached else None,
        "algorithms": rows,
    }


def describe(row, budget):
    if row["reached"]:
        return (
            f"{row['seconds']:.1f} s ({row['iterations']} {row['unit']}, "
            f"{row['distance']:.3f} sd)"
        )
    return (
        f"not reached in {budget:g} s (after {row['iterations']} {row['unit']}, "
        f"{row['seconds']:.1f} s: {row['distance']:.3f} sd; best {row['best_distance']:.3f})"
    )


def main(args):
    jax.config.update("jax_enable_x64", True)
    load_start = list(os.getloadavg())  # 1, 5, 15 min; the machine may be shared
    results = [bench(p, args) for p in args.problems]
    print(
        f"\nWall time (compilation included) until every global mean is within "
        f"{args.target} NUTS sd; budget {args.budget:g} s per algorithm"
    )
    print(
        f"{'problem':>11} {'algorithm':>9} {'seconds':>8} {'/ NUTS':>7} "
        f"{'iterations':>14} {'distance (sd)':>14}"
    )
    for res in results:
        print(
            f"{res['problem']:>11} {'NUTS':>9} {res['nuts_seconds']:>8.1f} "
            f"{1:>7.2f} {args.nuts_warmup + args.nuts_samples:>8} steps "
            f"{'(reference)':>14}"
        )
        for r in res["algorithms"]:
            if "error" in r:
                print(f"{res['problem']:>11} {r['algorithm']:>9} failed: {r['error']}")
                continue
            seconds = (
                f"{r['seconds']:>8.1f}"
                if r["reached"]
                else f"{'>' + format(args.budget, 'g'):>8}"
            )
            ratio = (
                f"{r['seconds'] / res['nuts_seconds']:>7.2f}"
                if r["reached"]
                else f"{'-':>7}"
            )
            print(
                f"{res['problem']:>11} {r['algorithm']:>9} {seconds} {ratio} "
                f"{r['iterations']:>8} {r['unit']:<5} {r['distance']:>14.3f}"
            )
        best = res["best_federated_over_nuts"]
        print(
            f"{res['problem']:>11} best federated / NUTS: "
            + (
                f"{best:.2f}"
                if best is not None
                else f"none reached in {args.budget:g} s"
            )
        )
    meta = {
        **machine_meta(),
        "load": args.load_note,
        "load_average_start": load_start,
        "load_average_end": list(os.getloadavg()),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "results": results}, indent=2))
    print(f"saved {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--silos", type=int, default=100)
    parser.add_argument(
        "--problems",
        nargs="+",
        default=["logistic", "six_cities"],
        choices=["logistic", "six_cities"],
    )
    parser.add_argument(
        "--algorithms",
        nargs="+",
        default=["SFVI", "SFVIAvg", "PVI", "FSGLD", "DSGLD"],
        choices=["SFVI", "SFVIAvg", "PVI", "FSGLD", "DSGLD"],
    )
    parser.add_argument("--target", type=float, default=0.1, help="in NUTS sds")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds each")
    parser.add_argument("--nuts-warmup", type=int, default=500)
    parser.add_argument("--nuts-samples", type=int, default=1000)
    parser.add_argument("--sfvi-chunk", type=int, default=250)
    parser.add_argument("--avg-chunk", type=int, default=25)
    parser.add_argument("--pvi-chunk", type=int, default=5)
    parser.add_argument("--sgld-chunk", type=int, default=10000, help="DSGLD")
    parser.add_argument("--fsgld-chunk", type=int, default=1000)
    parser.add_argument(
        "--sgld-loop",
        default="scan",
        choices=["scan", "mcmc"],
        help="FSGLD/DSGLD chunks: a jitted scan of kernel.sample, or MCMC.run continued",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--reference",
        default="",
        help="reuse the NUTS reference (mean, sd, seconds) of an earlier results JSON "
        "of the same problem and size instead of running NUTS (for exploring)",
    )
    parser.add_argument(
        "--load-note", default="", help="free text saved in the JSON's meta (load)"
    )
    parser.add_argument("--out", default="benchmarks/results/time_to_accuracy.json")
    main(parser.parse_args())
