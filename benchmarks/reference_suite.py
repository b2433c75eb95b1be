# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Benchmark: every algorithm on every published reference posterior
=================================================================

The posteriors are :mod:`numpyro_fed.reference` (Inference Gym 0.0.5 ground truth
and posteriordb reference draws; groups as silos). For each posterior this script

1. checks the port: NUTS on the pooled data (``--nuts-chains`` x ``--nuts-samples``,
   default 2 x 500, after as many warm-up steps; the local sites of eight schools and
   radon are non-centred with NumPyro's ``LocScaleReparam``, which changes the
   sampler's geometry, not the posterior). A port whose NUTS means miss the reference
   by more than its Monte Carlo tolerance (``nuts_tolerance``) is a harness bug, not an
   algorithm's (row verdict ``PORT MISSES``);
2. runs each algorithm with the groups as silos, draws from its posterior, and
   prints one row per (posterior, algorithm): the largest ``|mean - ref| / ref_sd``
   over every global coordinate, the range of ``sd / ref_sd``, for the VI algorithms
   the same family fitted centrally ("vs central": the largest ``|mean_fed -
   mean_central| / ref_sd`` and the range of ``sd_fed / sd_central``), the final loss
   (negative ELBO, or PVI's free energy; mean of the last 10% of rounds) where there
   is one, the wall time (compilation included), and a verdict;
3. ends with the count of each verdict and the cells that fail silently.

**Verdicts** (issue 22's done-when; ``benchmarks/_reference_checks.py``): ``ok``
within the algorithm's stated tolerance; ``warned`` outside it, but numpyro-fed
warned while the cell ran (the row names the warning); ``FAIL`` outside it, with no
warning; ``error`` the run raised (a clear library error refuses the problem).
Tolerances: SFVI, SFVI-MF, SFVIAvg and PVI are held to the same Gaussian family
fitted centrally, with one rule for every posterior:

- *like with like*: the central fit is NumPyro ``SVI`` with ``Trace_ELBO`` on the
  pooled data (as :func:`numpyro_fed.baselines.fit_centralized`;
  ``AutoGlobalLocalNormal`` for SFVI and SFVIAvg, ``AutoMeanField`` for SFVI-MF and
  PVI; the SFVI optimizer and steps, from the federated runs' own start, SFVI's
  ``init_to_uniform`` initialization), so every federated VI run uses the same
  estimator, ``stl=False`` (the default sticking-the-landing gradients reach the same
  fixed point more slowly: on eight_schools_noncentered, mean-field, 5,000 STL steps
  leave ``mu`` further from it than 1,000 ``Trace_ELBO`` steps); PVI otherwise keeps
  its defaults and starts from the prior;
- *both fits converged*: the optimizer's schedule anneals to 1e-2 / 1024 (below),
  so that two runs differing only in their seed agree to Monte Carlo level; centred
  eight schools still has local optima 2.5 sd apart, so the central fit is the
  lowest final loss of ``CENTRAL_SEEDS`` (3) seeds (once per posterior and family).
  Annealed Adam still stops short in flat directions (radon's
  ``county_effect_scale``: 0.30 reference sds from the optimum), so a VI cell that
  misses its twin is judged against the family's optimum itself: the pooled ELBO
  converged by BFGS on fixed noise draws (``checks.converged_fit``) from the twin's
  answer and from the cell's, the better of the two (a lower objective; the cell's
  ``central_refit`` records both);
- *a derived Monte Carlo allowance*: each global coordinate's ``|mean_fed -
  mean_central|`` and ``|sd_fed - sd_central|`` (in reference sds) less 4 standard
  errors of that difference between the two sets of 16,000 independent draws
  (``sqrt(sd_fed^2 / n + sd_central^2 / n)``, and that over ``sqrt(2)`` for the sds)
  must be within 0.1 reference sd (``compare_central``; the table's "vs central" is
  the raw difference).

FSGLD and DSGLD are held to the reference: every global coordinate's mean
within 0.2 reference sd, and ``sd / ref_sd`` within 0.8-1.25, less a *Monte Carlo
allowance derived from the chains* (``sgld_allowance``): their draws are
autocorrelated, so 4 standard errors from each coordinate's effective sample size
(``sd / sqrt(ess)`` for a mean, with the reference's own; from the effective sample
size of the squared deviations for an sd). A cell whose smallest effective sample
size is below 400 (``SGLD_MIN_ESS``, the library's ``warn_low_ess`` threshold: 4
standard errors of a mean are then over 0.2 sd) is never ``ok``: its numbers are
Monte Carlo noise, and the library warns of it (``warned``). The cell records each
coordinate's effective sample size (``mc``).

Settings, one rule for every posterior (never tuned per run):

- **SFVI** (guides ``AutoGlobalLocalNormal`` and ``AutoMeanField``): Adam from 1e-2,
  halved every tenth of the run (``optax.exponential_decay(1e-2, steps // 10,
  0.5)``, ending at 1e-2 / 1024), ``--sfvi-steps`` (20,000) steps, one particle,
  ``stl=False``; the central fits the same. Measured with five central runs from
  one start, differing only in their seeds: the earlier 5,000 steps halving every
  1,000 (ending at 3e-4) left German credit's pairs of runs up to 0.16 reference sd
  apart in mean (3 of 10 pairs over the tolerance after the Monte Carlo allowance)
  and radon's negative ELBO 1.3 nats above converged, with sds up to 0.25 reference
  sd apart: three SFVI cells failed against a central fit as unconverged as they
  were. With 20,000 steps halving every 2,000 every pair was within 0.05 (excess
  at most 0.014) on German credit (both families) and both radons.
- **SFVIAvg**: the same optimizer over the run's ``--avg-rounds`` (25) x
  ``--avg-local-steps`` (200) = 5,000 silo steps (so it anneals to 1e-2 / 1024 as
  well). Not the SFVI cells' 20,000: its misses are not a matter of convergence
  (German credit, 5 silos: 0.66 reference sd from the central fit with 25 rounds,
  1.13 with 100), and rounds are dear: each round's server step, the W2 barycenter
  of the silos' full-covariance global Gaussians, costs the fixed-point
  iteration's ``(J + 1)`` symmetric eigendecompositions per iteration: about 4 s a
  round for item-response theory's 101 global coordinates and 20 silos on 2 loaded
  cores (500 rounds of 10 steps took 1,257 s).
- **PVI**: the library defaults (``AutoMeanField``, synchronous, damping, local
  steps, particles, the average of the last half of the rounds' q) but
  ``stl=False``, ``--pvi-rounds`` (200) rounds, ``--pvi-curvature`` (the default ``"auto"``: the
  Hessian average up to 50 global coordinates, Stein's lemma on item-response
  theory's 101).
- **FSGLD / DSGLD**: step size ``h = 0.01 * s^2``, ``s`` the smallest reference
  sd in the samplers' own unconstrained coordinates (the delta method at the
  reference mean: ``sd / mean`` for a positive site). The samplers move there:
  the rule on constrained sds gave eight_schools_noncentered's ``tau`` (sd 3.2,
  log-scale sd 0.89) ``h = 0.2``, and its mean 0.30-0.35 sd low at an effective
  sample size of 6,000-9,000 (bias, 23 standard errors), 0.07 at this rule. The
  constant is radon's calibration (0.02 on constrained sds: 0.05 left the sds up
  to 1.46x) carried over to unconstrained ones (``log_radon_scale``: 0.018 and
  0.024). ``tau = 1``, the samplers' default local steps
  (5 local refreshes before each step when the model has local sites and several
  silos) and conducive radius, minibatches of ``min(100, smallest silo)`` units,
  ``--sgld-steps`` (150,000) Langevin steps after as many warm-up steps, 2 chains,
  thinned 10x; FSGLD's surrogates ``nf.fit_surrogates(model, data, method="vi",
  prior_power=1 / J)`` (fitted inside the timed call; the default Laplace fit
  refuses the funnels of eight schools and radon, rightly).

Draws: 16,000 from each VI posterior (``sample_posterior``), the thinned chains for
FSGLD / DSGLD, 16,000 from each central fit. Float64 throughout. A cell marked ``nan``
means the run returned non-finite draws. Wall times depend on the machine and its
load: the JSON records ``os.getloadavg()`` at the start and the end, and the commit.

Run: ``python benchmarks/reference_suite.py`` (``make reference``; writes
``benchmarks/results/reference/suite.json``); ``--posteriors`` / ``--algorithms``
pick a subset; ``--quick`` runs short settings. From a fresh clone on 2 cores shared
with other work (load average 1.1 to 5.3), ``make reference`` took 34 minutes 47
seconds, the suite itself 2,016 s (PVI on item-response theory 752 s of it).
"""

import argparse
import json
import os
from pathlib import Path
import subprocess
import time
import warnings

import jax

jax.config.update("jax_enable_x64", True)

import _reference_checks as checks  # noqa: E402  (benchmarks/ is on sys.path)
from _timing import machine_meta  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
from numpyro.infer import MCMC, NUTS  # noqa: E402
from numpyro.infer.reparam import LocScaleReparam  # noqa: E402
import optax  # noqa: E402

import numpyro_fed as nf  # noqa: E402
from numpyro_fed import expfam, reference, sgld_diagnostics  # noqa: E402
from numpyro_fed.infer.vi import pooled_guide_params  # noqa: E402
from numpyro_fed.potentials import federated_potential  # noqa: E402

RESULTS = Path(__file__).parent / "results" / "reference"
ALGORITHMS = ("SFVI", "SFVI-MF", "SFVIAvg", "PVI", "FSGLD", "DSGLD")
NUM_DRAWS = 16_000  # from each VI posterior and each central fit
# FSGLD / DSGLD step size, in units of (smallest unconstrained reference sd)^2
SGLD_STEP = 0.01
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


def _adam(num_steps):
    """Every VI optimizer of the suite: Adam from 1e-2, halved every tenth of the run's
    ``num_steps`` (so it ends at 1e-2 / 1024 whatever the length)."""
    return optax.adam(optax.exponential_decay(1e-2, max(num_steps // 10, 1), 0.5))


def _vi_draws(fit, result, post, key, num_samples=NUM_DRAWS):
    draws = fit.sample_posterior(key, result.params, post.data, num_samples=num_samples)
    losses = np.asarray(result.losses)
    tail = losses[-max(len(losses) // 10, 1) :]
    draws = {k: np.asarray(draws[k]) for k in post.reference}
    return draws, float(np.mean(tail)), None, result.params


def _sgld(kernel, post, key, steps):
    """Draws of the global sites (chains merged) and the chains. The library's
    ``warn_low_ess`` warns (into the cell) of the chains that diverged and when the
    chains are too short for their means to be trusted, as it would in a user's
    run."""
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
    sgld_diagnostics.warn_low_ess(
        mcmc, sites=post.reference, name=type(kernel).__name__
    )
    chains = mcmc.get_samples(group_by_chain=True)
    chains = {k: np.asarray(chains[k]) for k in post.reference}
    draws = {k: v.reshape((-1,) + v.shape[2:]) for k, v in chains.items()}
    return draws, None, chains, None


def sgld_step_size(post):
    """The samplers' step size: ``SGLD_STEP`` times the square of the smallest
    reference sd in the samplers' own unconstrained coordinates, by the delta
    method at the reference mean (``sd / mean`` for a positive site)."""
    pot = federated_potential(post.fed_model, post.data)
    smallest = np.inf
    for site, ref in post.reference.items():
        mean = jax.numpy.asarray(ref.mean, dtype=float)
        _, slope = jax.jvp(
            lambda v, site=site: pot.unconstrain({site: v})[site],
            (mean,),
            (jax.numpy.ones_like(mean),),
        )
        smallest = min(smallest, float(np.min(np.abs(np.asarray(slope)) * ref.sd)))
    return SGLD_STEP * smallest**2


def vi_start(family, post, key):
    """The constrained starting point of every VI run of ``family`` on ``post`` and of
    its central twin: SFVI's initialization (``init_to_uniform``) from ``key``."""
    fit = nf.SFVI(post.fed_model, checks.GUIDES[family](post.fed_model), _adam(1))
    return fit.get_params(fit.init(key, post.data))


def run_algorithm(name, post, key, settings, start=None):
    """Draws of the global sites, the final loss (None for the samplers), the
    samplers' chains, ``(chains, draws, ...)`` per site (None for the VI
    algorithms, whose draws are independent) and the VI algorithms' constrained
    parameters (None for the samplers);
    ``start``: the VI family's starting point (:func:`vi_start`; PVI starts from the
    prior, its default)."""
    fed, data = post.fed_model, post.data
    run_key, draw_key = jax.random.split(key)
    if name in ("SFVI", "SFVI-MF"):
        optim = _adam(settings["sfvi_steps"])
        fit = nf.SFVI(fed, checks.GUIDES[checks.FAMILY[name]](fed), optim, stl=False)
        result = fit.run(
            run_key, settings["sfvi_steps"], data, init_params=start, progress_bar=False
        )
        return _vi_draws(fit, result, post, draw_key)
    if name == "SFVIAvg":
        fit = nf.SFVIAvg(
            fed,
            nf.AutoGlobalLocalNormal(fed),
            _adam(settings["avg_rounds"] * settings["avg_local_steps"]),
            local_steps=settings["avg_local_steps"],
            stl=False,
        )
        result = fit.run(
            run_key, settings["avg_rounds"], data, init_params=start, progress_bar=False
        )
        return _vi_draws(fit, result, post, draw_key)
    if name == "PVI":
        fit = nf.PVI(fed, stl=False, curvature=settings["pvi_curvature"])
        result = fit.run(run_key, settings["pvi_rounds"], data, progress_bar=False)
        return _vi_draws(fit, result, post, draw_key)
    h = sgld_step_size(post)
    batch = min(100, min(data.sizes))
    if name == "FSGLD":
        q = nf.fit_surrogates(
            fed, data, method="vi", prior_power=1 / data.num_silos, progress_bar=False
        )
        kernel = nf.FSGLD(fed, h, q, batch_size=batch)
    elif name == "DSGLD":
        kernel = nf.DSGLD(fed, h, batch_size=batch)
    else:
        raise ValueError(f"Unknown algorithm {name!r}; known: {ALGORITHMS}.")
    return _sgld(kernel, post, run_key, settings["sgld_steps"])


def run_cell(algorithm, post, key, settings, start=None):
    """One (posterior, algorithm) cell: score, loss, time, finiteness, and the
    warnings numpyro-fed raised while it ran (the error, if it raised)."""
    begin = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            draws, loss, chains, params = run_algorithm(
                algorithm, post, key, settings, start
            )
        except Exception as err:  # a failed cell is a result, not a crash
            message = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
            draws, loss, chains, params = None, None, None, None
        else:
            message = None
    cell = {
        "seconds": time.perf_counter() - begin,
        "warnings": checks.library_warnings(caught),
    }
    if message is not None:
        return {**cell, "error": message}, None, None
    finite = all(np.isfinite(v).all() for v in draws.values())
    nan = {"mean_error": float("nan"), "sd_ratio": (float("nan"),) * 2}
    scored = reference.score(draws, post.reference) if finite else {"all": nan}
    cell = {**cell, "score": scored, "loss": loss, "finite": finite}
    if chains is not None and finite:
        cell["mc"] = checks.sgld_allowance(chains, post.reference)
    return cell, draws, params


def _central(cache, family, post, key, settings, record):
    """The central fit of ``family`` on ``post`` from the family's start, once per run
    (None if it raised)."""
    if (post.name, family) not in cache:
        begin = time.perf_counter()
        try:
            draws, loss, params = checks.central_fit(
                family,
                post,
                key,
                _adam(settings["sfvi_steps"]),
                settings["sfvi_steps"],
                NUM_DRAWS,
                cache["start"][(post.name, family)],
            )
            cache["params"][(post.name, family)] = params
            entry = {"score": reference.score(draws, post.reference), "loss": loss}
        except Exception as err:  # the VI cells of this family then read n/a
            draws = None
            entry = {"error": f"{type(err).__name__}: {str(err).splitlines()[0]}"}
        entry["seconds"] = time.perf_counter() - begin
        record["central"][f"{post.name}/{family}"] = entry
        cache[(post.name, family)] = draws
    return cache[(post.name, family)]


def _refit_central(cell, draws, params, family, post, key, cache):
    """A VI cell that misses its central twin: is the twin at the family's optimum?
    The pooled ELBO is converged (:func:`checks.converged_fit`, BFGS on fixed draws)
    from the twin's answer and from the cell's, and the cell is judged against the
    better of the two optima (the lower converged objective): Adam's annealed
    schedule stops short in flat directions (radon's ``county_effect_scale``: 0.30
    reference sds), and centred eight schools has several optima.
    ``cell["central_refit"]`` records both objectives and which optimum was used, or
    that the data were too large for it (the twin then stands)."""
    num_draws = checks.saa_draws(post)
    if num_draws is None:
        cell["central_refit"] = {"skipped": "too much data for a converged fit"}
        return
    fitted = {}
    try:
        for name, start in (
            ("central", cache["params"][(post.name, family)]),
            ("answer", pooled_guide_params(params, post.data)),
        ):
            fitted[name] = checks.converged_fit(family, post, key, start, NUM_DRAWS)
    except Exception as err:  # noqa: BLE001 - the seeds' fit then stands
        cell["central_refit"] = {"error": f"{type(err).__name__}: {err}"[:160]}
        return
    used = min(fitted, key=lambda name: fitted[name][1])
    cell["central_refit"] = {
        "objective": {name: fit[1] for name, fit in fitted.items()},
        "converged": {name: fit[3] for name, fit in fitted.items()},
        "draws": num_draws,
        "used": used,
    }
    cell["central"] = checks.compare_central(draws, fitted[used][0], post.reference)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    p.add_argument("--posteriors", nargs="+", default=list(reference.names()))
    p.add_argument("--algorithms", nargs="*", default=list(ALGORITHMS))
    p.add_argument("--nuts-samples", type=int, default=500)
    p.add_argument("--nuts-chains", type=int, default=2)
    p.add_argument("--no-nuts", action="store_true", help="skip the port checks")
    p.add_argument("--sfvi-steps", type=int, default=20_000)
    p.add_argument("--avg-rounds", type=int, default=25)
    p.add_argument("--avg-local-steps", type=int, default=200)
    p.add_argument("--pvi-rounds", type=int, default=200)
    p.add_argument("--pvi-curvature", choices=expfam.CURVATURES, default="auto")
    p.add_argument("--sgld-steps", type=int, default=150_000)
    p.add_argument("--quick", action="store_true", help="short settings (smoke run)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "suite.json")
    args = p.parse_args(argv)
    if args.quick:
        args.nuts_samples, args.nuts_chains = 200, 1
        args.sfvi_steps, args.avg_rounds, args.pvi_rounds = 200, 2, 10
        args.sgld_steps = 2000
    settings = {
        "sfvi_steps": args.sfvi_steps,
        "avg_rounds": args.avg_rounds,
        "avg_local_steps": args.avg_local_steps,
        "pvi_rounds": args.pvi_rounds,
        "pvi_curvature": args.pvi_curvature,
        "sgld_steps": args.sgld_steps,
    }
    key = jax.random.key(args.seed)
    record = {"settings": {**settings, **vars(args), "out": str(args.out)}}
    record["machine"] = machine_meta()
    record["commit"] = _commit()
    record["loadavg_start"] = list(os.getloadavg())
    record["tolerances"] = {
        "vi_vs_central": checks.VI_TOLERANCE,
        "sgld_mean": checks.SGLD_MEAN_TOLERANCE,
        "sgld_sd_ratio": checks.SGLD_SD_RATIO,
    }
    record["nuts"], record["central"], record["runs"] = {}, {}, {}
    rows, cache = [], {"start": {}, "params": {}}
    start_all = time.perf_counter()
    print(checks.HEADER, flush=True)
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
            within = all(scored[s]["mean_error"] <= tol[s] for s in tol)
            record["nuts"][name] = {
                "score": scored,
                "tolerance": tol,
                "divergences": divergences,
                "seconds": seconds,
                "within": within,
            }
            cell = {"score": scored, "seconds": seconds, "verdict": "port ok"}
            if not within:
                cell["verdict"] = "PORT MISSES"
            rows.append(checks.row(name, "NUTS", cell))
            print(rows[-1], f"(divergences {divergences})", flush=True)
        key, start_key = jax.random.split(key)
        for family in {checks.FAMILY.get(a) for a in args.algorithms} - {None}:
            cache["start"][(name, family)] = vi_start(family, post, start_key)
        for algorithm in args.algorithms:
            key, sub, central_key = jax.random.split(key, 3)
            family = checks.FAMILY.get(algorithm)
            start = cache["start"][(name, family)] if family else None
            cell, draws, params = run_cell(algorithm, post, sub, settings, start)
            if family is not None and draws is not None and cell["finite"]:
                central = _central(cache, family, post, central_key, settings, record)
                if central is not None:
                    cell["central"] = checks.compare_central(
                        draws, central, post.reference
                    )
                    if not checks.within_tolerance(algorithm, cell)[0]:
                        _refit_central(cell, draws, params, family, post, central_key,
                                       cache)  # fmt: skip
            cell["verdict"], cell["reason"] = checks.verdict(algorithm, cell)
            record["runs"][f"{name}/{algorithm}"] = cell
            rows.append(checks.row(name, algorithm, cell))
            print(rows[-1], flush=True)
            _save(args.out, record, rows)  # after every cell: a long run keeps its rows
    record["summary"] = checks.summary(record["runs"])
    record["seconds"] = time.perf_counter() - start_all
    record["loadavg_end"] = list(os.getloadavg())
    _save(args.out, record, rows)
    counts = record["summary"]["counts"]
    print("verdicts:", ", ".join(f"{k} {v}" for k, v in counts.items()))
    for cell_name in record["summary"]["silent_failures"]:
        print(f"silent FAIL: {cell_name}: {record['runs'][cell_name]['reason']}")
    print(f"wrote {args.out} ({record['seconds']:.0f} s)")
    return record


def _commit():
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _save(out, record, rows):
    out.parent.mkdir(parents=True, exist_ok=True)
    record["table"] = [checks.HEADER, *rows]
    out.write_text(json.dumps(record, indent=1, default=float) + "\n")


if __name__ == "__main__":
    main()
