# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Benchmark: every algorithm on every published reference posterior
=================================================================

The posteriors are :mod:`numpyro_fed.reference` (Inference Gym 0.0.5 ground truth
and posteriordb reference draws; groups as silos). For each posterior this script

1. checks the port: NUTS on the pooled data (``--nuts-chains`` x ``--nuts-samples``
   after as many warm-up steps; the local sites of eight schools and radon are
   non-centred with NumPyro's ``LocScaleReparam``, which changes the sampler's
   geometry, not the posterior). A port whose NUTS means miss the reference by more
   than ~0.1 reference sd is a harness bug, not an algorithm's;
2. runs each algorithm with the groups as silos, draws from its posterior, and
   prints one row per (posterior, algorithm): the largest ``|mean - ref| / ref_sd``
   over every global coordinate, the range of ``sd / ref_sd``, the final loss
   (negative ELBO, or PVI's free energy; mean of the last 10% of rounds) where
   there is one, and the wall time (compilation included).

Settings, one rule for every posterior (never tuned per run):

- **SFVI** (guides ``AutoGlobalLocalNormal`` and ``AutoMeanField``): Adam,
  ``optax.exponential_decay(1e-2, 1000, 0.5)``, ``--sfvi-steps`` rounds, one particle.
- **SFVIAvg**: the same optimizer, ``local_steps=10``, ``--avg-rounds`` rounds.
- **PVI**: the library defaults (``AutoMeanField``, synchronous, damping, local
  steps, particles), ``--pvi-rounds`` rounds.
- **FSGLD / DSGLD**: step size ``h = 0.05 * (smallest reference sd)^2`` (a scale
  read off the globals' published sds; local sites and the unconstrained space of a
  positive site can be stiffer: eight_schools_noncentered's ``tau``, sd 3.2, gives
  ``h = 0.51``), ``tau = 1``, ``local_steps = 5`` (a silo refreshes its local
  sites before each step; issue 22: with ``tau = 10`` and lagging locals radon's
  sds were 4.8x too wide), minibatches of ``min(100, smallest silo)`` units,
  ``--sgld-steps`` Langevin steps after as many warm-up steps, 2 chains, thinned
  10x; FSGLD's surrogates ``nf.fit_surrogates(model, data,
  prior_power=1 / J)`` (fitted inside the timed call).

Draws: 4,000 from each VI posterior (``sample_posterior``), the thinned chains for
FSGLD / DSGLD. Float64 throughout. A cell marked ``nan`` means the run returned
non-finite draws. Wall times depend on the machine and its load.

Run: ``python benchmarks/reference_suite.py`` (``make reference``; writes
``benchmarks/results/reference/suite.json``); ``--posteriors`` / ``--algorithms``
pick a subset; ``--quick`` runs short settings.
"""

import argparse
import json
from pathlib import Path
import time

import jax

jax.config.update("jax_enable_x64", True)

from _timing import machine_meta  # noqa: E402  (benchmarks/ is on sys.path)
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
from numpyro.infer import MCMC, NUTS  # noqa: E402
from numpyro.infer.reparam import LocScaleReparam  # noqa: E402
import optax  # noqa: E402

import numpyro_fed as nf  # noqa: E402
from numpyro_fed import reference  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "reference"
ALGORITHMS = ("SFVI", "SFVI-MF", "SFVIAvg", "PVI", "FSGLD", "DSGLD")
# Centred local sites that NUTS samples non-centred (the posterior is unchanged).
_NONCENTER = {"eight_schools": "school_effects", "radon": "county_effect"}


def nuts_model(post):
    """The pooled model NUTS runs: the port itself, its centred local site (if any)
    reparameterized."""
    for prefix, site in _NONCENTER.items():
        if post.name.startswith(prefix) and "noncentered" not in post.name:
            return numpyro.handlers.reparam(
                post.model, config={site: LocScaleReparam(0)}
            )
    return post.model


def run_nuts(post, key, warmup, samples, chains):
    mcmc = MCMC(
        NUTS(nuts_model(post), target_accept_prob=0.9),
        num_warmup=warmup,
        num_samples=samples,
        num_chains=chains,
        chain_method="sequential",
        progress_bar=False,
    )
    mcmc.run(key, **post.data.pooled())
    draws = mcmc.get_samples()
    divergences = int(mcmc.get_extra_fields()["diverging"].sum())
    return {k: np.asarray(draws[k]) for k in post.reference}, divergences


def nuts_tolerance(post, draws, chains):
    """A tolerance on ``|mean - ref| / ref_sd`` from Monte Carlo error: 4 standard
    errors of the difference (NUTS's with an ESS of a quarter of its draws, and the
    reference's published one), plus 0.02 for the reference's own rounding."""
    out = {}
    for site, ref in post.reference.items():
        n_eff = max(len(draws[site]) / 4, 1)
        se = np.sqrt(1 / n_eff + (ref.mcse / ref.sd) ** 2)
        out[site] = float(4 * np.max(se) + 0.02)
    return out


def _adam():
    return optax.adam(optax.exponential_decay(1e-2, 1000, 0.5))


def _vi_draws(fit, result, post, key, num_samples=4000):
    draws = fit.sample_posterior(key, result.params, post.data, num_samples=num_samples)
    losses = np.asarray(result.losses)
    tail = losses[-max(len(losses) // 10, 1) :]
    return {k: np.asarray(draws[k]) for k in post.reference}, float(np.mean(tail))


def _sgld(kernel, post, key, steps):
    mcmc = MCMC(
        kernel,
        num_warmup=steps,
        num_samples=steps,
        num_chains=2,
        chain_method="vectorized",
        thinning=10,
        progress_bar=False,
    )
    mcmc.run(key, post.data)
    draws = mcmc.get_samples()
    return {k: np.asarray(draws[k]) for k in post.reference}, None


def run_algorithm(name, post, key, settings):
    """Draws of the global sites and the final loss (None for the samplers)."""
    fed, data = post.fed_model, post.data
    run_key, draw_key = jax.random.split(key)
    if name in ("SFVI", "SFVI-MF"):
        guide = nf.AutoGlobalLocalNormal if name == "SFVI" else nf.AutoMeanField
        fit = nf.SFVI(fed, guide(fed), _adam())
        result = fit.run(run_key, settings["sfvi_steps"], data, progress_bar=False)
        return _vi_draws(fit, result, post, draw_key)
    if name == "SFVIAvg":
        fit = nf.SFVIAvg(fed, nf.AutoGlobalLocalNormal(fed), _adam(), local_steps=10)
        result = fit.run(run_key, settings["avg_rounds"], data, progress_bar=False)
        return _vi_draws(fit, result, post, draw_key)
    if name == "PVI":
        fit = nf.PVI(fed)
        result = fit.run(run_key, settings["pvi_rounds"], data, progress_bar=False)
        return _vi_draws(fit, result, post, draw_key)
    min_sd = min(float(np.min(r.sd)) for r in post.reference.values())
    h = 0.05 * min_sd**2
    batch = min(100, min(data.sizes))
    if name == "FSGLD":
        q = nf.fit_surrogates(fed, data, prior_power=1 / data.num_silos)
        kernel = nf.FSGLD(fed, h, q, batch_size=batch, local_steps=5)
    elif name == "DSGLD":
        kernel = nf.DSGLD(fed, h, batch_size=batch, local_steps=5)
    else:
        raise ValueError(f"Unknown algorithm {name!r}; known: {ALGORITHMS}.")
    return _sgld(kernel, post, run_key, settings["sgld_steps"])


def _row(posterior, algorithm, scored, loss, seconds, error=None):
    if error is not None:
        return f"{posterior:<46} {algorithm:<8} failed: {error}"
    lo, hi = scored["all"]["sd_ratio"]
    loss_text = f"{loss:12.2f}" if loss is not None else f"{'-':>12}"
    return (
        f"{posterior:<46} {algorithm:<8} {scored['all']['mean_error']:8.3f} "
        f"{lo:6.2f}-{hi:<6.2f} {loss_text} {seconds:8.1f}"
    )


HEADER = (
    f"{'posterior':<46} {'algo':<8} {'max|err|':>8} {'sd ratio':<13} "
    f"{'loss':>12} {'time (s)':>8}"
)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--posteriors", nargs="+", default=list(reference.names()))
    p.add_argument("--algorithms", nargs="*", default=list(ALGORITHMS))
    p.add_argument("--nuts-samples", type=int, default=1000)
    p.add_argument("--nuts-chains", type=int, default=4)
    p.add_argument("--no-nuts", action="store_true", help="skip the port checks")
    p.add_argument("--sfvi-steps", type=int, default=5000)
    p.add_argument("--avg-rounds", type=int, default=500)
    p.add_argument("--pvi-rounds", type=int, default=200)
    p.add_argument("--sgld-steps", type=int, default=100_000)
    p.add_argument("--quick", action="store_true", help="short settings (smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "suite.json")
    args = p.parse_args(argv)
    if args.quick:
        args.nuts_samples, args.nuts_chains = 200, 1
        args.sfvi_steps, args.avg_rounds, args.pvi_rounds = 200, 20, 10
        args.sgld_steps = 2000
    settings = {
        "sfvi_steps": args.sfvi_steps,
        "avg_rounds": args.avg_rounds,
        "pvi_rounds": args.pvi_rounds,
        "sgld_steps": args.sgld_steps,
    }
    key = jax.random.key(args.seed)
    record = {"settings": {**settings, **vars(args), "out": str(args.out)}}
    record["machine"] = machine_meta()
    record["nuts"], record["runs"] = {}, {}
    rows = []
    print(HEADER, flush=True)
    for name in args.posteriors:
        post = reference.load(name)
        if not args.no_nuts:
            key, sub = jax.random.split(key)
            start = time.perf_counter()
            draws, divergences = run_nuts(
                post, sub, args.nuts_samples, args.nuts_samples, args.nuts_chains
            )
            seconds = time.perf_counter() - start
            scored = reference.score(draws, post.reference)
            tol = nuts_tolerance(post, draws, args.nuts_chains)
            record["nuts"][name] = {
                "score": scored,
                "tolerance": tol,
                "divergences": divergences,
                "seconds": seconds,
                "within": all(scored[s]["mean_error"] <= tol[s] for s in tol),
            }
            rows.append(_row(name, "NUTS", scored, None, seconds))
            print(rows[-1], f"(divergences {divergences})", flush=True)
        for algorithm in args.algorithms:
            key, sub = jax.random.split(key)
            start = time.perf_counter()
            try:
                draws, loss = run_algorithm(algorithm, post, sub, settings)
                seconds = time.perf_counter() - start
                finite = all(np.isfinite(v).all() for v in draws.values())
                scored = (
                    reference.score(draws, post.reference)
                    if finite
                    else {
                        "all": {"mean_error": float("nan"), "sd_ratio": (np.nan,) * 2}
                    }
                )
                rows.append(_row(name, algorithm, scored, loss, seconds))
                record["runs"][f"{name}/{algorithm}"] = {
                    "score": scored,
                    "loss": loss,
                    "seconds": seconds,
                    "finite": finite,
                }
            except Exception as err:  # a failed cell is a result, not a crash
                seconds = time.perf_counter() - start
                message = f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"
                rows.append(_row(name, algorithm, None, None, seconds, message))
                record["runs"][f"{name}/{algorithm}"] = {
                    "error": message,
                    "seconds": seconds,
                }
            print(rows[-1], flush=True)
            _save(args.out, record, rows)  # after every cell: a long run keeps its rows
    _save(args.out, record, rows)
    print(f"wrote {args.out}")
    return record


def _save(out, record, rows):
    out.parent.mkdir(parents=True, exist_ok=True)
    record["table"] = [HEADER, *rows]
    out.write_text(json.dumps(record, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
