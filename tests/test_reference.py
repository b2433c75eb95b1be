# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The reference-posterior suite (numpyro_fed.reference, benchmarks/reference_suite.py):
vendored data and summaries, a NUTS check of one port, and one quick table row."""

import importlib.util
from pathlib import Path
import sys

import jax
import numpy as np
import numpyro
import pytest

from numpyro_fed import reference

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _suite():
    sys.path.insert(0, str(BENCHMARKS))  # the suite imports benchmarks/_timing.py
    try:
        spec = importlib.util.spec_from_file_location(
            "reference_suite", BENCHMARKS / "reference_suite.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module


@pytest.mark.parametrize("name", reference.names())
def test_summaries_match_the_model_sites(name):
    """Every posterior loads; each reference site is a sample site of the model, with
    the site's shape, positive sds and standard errors below a tenth of the sd."""
    post = reference.load(name)
    trace = numpyro.handlers.trace(
        numpyro.handlers.seed(post.model, jax.random.key(0))
    ).get_trace(**post.data.pooled())
    for site, ref in post.reference.items():
        assert trace[site]["type"] == "sample" and not trace[site]["is_observed"]
        assert ref.mean.shape == ref.sd.shape == ref.mcse.shape
        assert np.shape(trace[site]["value"]) == ref.mean.shape, site
        assert (ref.sd > 0).all() and (ref.mcse < 0.1 * ref.sd).all(), site
    assert post.source


def test_radon_data_are_the_gym_transform_of_the_raw_values():
    """Minnesota: 919 homes in 85 counties of 1-116 homes; log radon is log(activity)
    with 0 -> 0.1 (not posteriordb's log(x + 0.1)); Aitkin's first homes."""
    post = reference.load("radon_contextual_effects_minnesota")
    data = post.data
    sizes = [shapes["floor"][1] for shapes in data.silo_shapes]
    assert data.num_silos == 85 and sum(sizes) == 919
    assert min(sizes) == 1 and max(sizes) == 116
    aitkin = data.silo(0)
    np.testing.assert_allclose(
        np.sort(np.asarray(aitkin["log_radon"][0])), np.log([1.0, 2.2, 2.2, 2.9])
    )
    np.testing.assert_allclose(aitkin["log_uranium"], np.log([0.502054]))
    assert float(aitkin["floor_by_county"][0]) == 0.25
    pooled = data.pooled()
    radon = np.asarray(pooled["log_radon"])[np.asarray(pooled["home"])]
    assert np.isclose(radon.min(), np.log(0.1)) and (radon == np.log(0.1)).sum() == 4


def test_german_credit_is_standardized_with_bad_as_one():
    post = reference.load("german_credit_numeric_logistic_regression")
    pooled = post.data.pooled()
    features, labels = np.asarray(pooled["features"]), np.asarray(pooled["labels"])
    assert features.shape == (1000, 24) and labels.sum() == 300
    np.testing.assert_allclose(features.mean(0), 0.0, atol=1e-12)
    np.testing.assert_allclose(features.std(0), 1.0, atol=1e-12)
    assert post.data.sizes == (200,) * 5


def test_score_reports_the_worst_coordinate():
    ref = {
        "w": reference.Reference(np.zeros(2), np.array([1.0, 2.0]), np.zeros(2)),
    }
    draws = {"w": np.array([[1.0, 0.0], [3.0, 0.0], [1.0, 4.0], [3.0, 4.0]])}
    scored = reference.score(draws, ref)
    assert scored["w"]["mean_error"] == 2.0  # coordinate 0: |2 - 0| / 1
    assert scored["all"]["sd_ratio"] == (1.0, 1.0)
    with pytest.raises(ValueError, match="'v'"):
        reference.score({"w": draws["w"]}, {**ref, "v": ref["w"]})


def test_nuts_on_pooled_eight_schools_matches_the_gym():
    """The port (model and data) is the gym's: NUTS on the pooled data is within the
    tolerance its own Monte Carlo error and the reference's allow."""
    suite = _suite()
    post = reference.load("eight_schools")
    draws, _ = suite.run_nuts(post, jax.random.key(1), 300, 1000, 2)
    scored = reference.score(draws, post.reference)
    tolerance = suite.nuts_tolerance(post, draws, 2)
    for site, tol in tolerance.items():
        assert tol < 0.25
        assert scored[site]["mean_error"] <= tol, (site, scored[site], tol)
        lo, hi = scored[site]["sd_ratio"]
        assert 1 - 2.5 * tol < lo and hi < 1 + 2.5 * tol, (site, scored[site])


def test_quick_run_prints_a_finite_row(tmp_path, capsys):
    suite = _suite()
    out = tmp_path / "suite.json"
    record = suite.main(
        [
            "--posteriors", "eight_schools_noncentered",
            "--algorithms", "DSGLD",
            "--no-nuts", "--sgld-steps", "200", "--out", str(out),
        ]
    )  # fmt: skip
    run = record["runs"]["eight_schools_noncentered/DSGLD"]
    assert run["finite"] and np.isfinite(run["score"]["all"]["mean_error"])
    assert run["verdict"] in suite.checks.VERDICTS and isinstance(run["warnings"], list)
    assert sum(record["summary"]["counts"].values()) == 1
    assert len(record["loadavg_start"]) == len(record["loadavg_end"]) == 3
    row = capsys.readouterr().out.splitlines()[1].split()
    assert row[:2] == ["eight_schools_noncentered", "DSGLD"]
    assert np.isfinite(float(row[2])) and np.isfinite(float(row[7]))  # error, time
    assert row[8] == run["verdict"]
    assert out.exists()


def _cell(**kwargs):
    score = {"all": {"mean_error": 0.1, "sd_ratio": (0.9, 1.1)}}
    return {"finite": True, "warnings": [], "score": score, **kwargs}


def test_verdicts_follow_each_algorithms_stated_tolerance():
    """VI against its central twin (0.1 reference sd in mean and sd), SGLD against
    the reference (0.2 sd, sd ratio 0.8-1.25); outside: warned if the library said
    so, FAIL if silent; a raised run is an error."""
    checks = _suite().checks
    near = {"mean_diff": 0.09, "sd_diff": 0.1, "sd_ratio": (0.95, 1.0)}
    far = {**near, "sd_diff": 0.11}
    warned = [{"category": "UserWarning", "message": "PVI: drifting"}]
    cells = {
        "SFVI": _cell(central=near),
        "PVI": _cell(central=far, warnings=warned),
        "SFVIAvg": _cell(central={**near, "mean_diff": 0.5}),
        "SFVI-MF": _cell(),
        "DSGLD": _cell(score={"all": {"mean_error": 0.2, "sd_ratio": (0.8, 1.26)}}),
        "FSGLD": _cell(score={"all": {"mean_error": 0.2, "sd_ratio": (0.8, 1.25)}}),
    }
    got = {name: checks.verdict(name, cell) for name, cell in cells.items()}
    assert {name: v for name, (v, _) in got.items()} == {
        "SFVI": "ok",
        "PVI": "warned",
        "SFVIAvg": "FAIL",
        "SFVI-MF": "n/a",
        "DSGLD": "FAIL",
        "FSGLD": "ok",
    }
    assert "PVI: drifting" in got["PVI"][1] and "1.26" in got["DSGLD"][1]
    assert checks.verdict("FSGLD", _cell(finite=False))[0] == "FAIL"
    # The tolerance applies to the difference less its Monte Carlo allowance.
    noisy = {**near, "mean_diff": 0.3, "mean_excess": 0.1, "sd_excess": 0.0}
    assert checks.verdict("SFVI", _cell(central=noisy))[0] == "ok"
    assert checks.verdict("SFVI", _cell(central={**noisy, "sd_excess": 0.11}))[0] == (
        "FAIL"
    )
    assert checks.verdict("SFVI", {"error": "ValueError: x"}) == (
        "error",
        "ValueError: x",
    )
    runs = {name: {"verdict": v} for name, (v, _) in got.items()}
    summary = checks.summary(runs)
    assert summary["counts"] == {"ok": 2, "warned": 1, "FAIL": 2, "error": 0, "n/a": 1}
    assert summary["silent_failures"] == ["SFVIAvg", "DSGLD"]


def test_sgld_allowance_is_four_standard_errors_of_the_chains():
    """A sampler's mean error less 4 standard errors from its effective sample size
    (and the reference's own), its sd ratio pulled toward 1 by 4 standard errors
    from the squared deviations' effective sample size."""
    from numpyro.diagnostics import effective_sample_size

    checks = _suite().checks
    x = np.random.default_rng(0).normal(0.3, 2.0, size=(2, 500))
    ref = {"m": reference.Reference(np.array(0.0), np.array(2.0), np.array(0.1))}
    got = checks.sgld_allowance({"m": x}, ref)
    flat = x.ravel()
    n, sq = effective_sample_size(x), (x - flat.mean()) ** 2
    se = np.sqrt(flat.std() ** 2 / n + 0.1**2) / 2.0
    se_ratio = sq.std() / np.sqrt(effective_sample_size(sq)) / (2 * flat.std() * 2.0)
    ratio = flat.std() / 2.0
    assert got["mean_excess"] == pytest.approx(abs(flat.mean()) / 2.0 - 4 * se)
    assert got["sd_ratio_allowed"] == pytest.approx(
        (ratio + 4 * se_ratio, ratio - 4 * se_ratio)
    )
    assert got["min_ess"] == pytest.approx(float(n)) and 500 < n < 2000


def test_sgld_verdict_needs_enough_effective_samples():
    """Within tolerance after the allowance: ok; below the library's ESS threshold
    never ok, whatever the raw numbers (warned when the library said so)."""
    checks = _suite().checks
    raw = {"all": {"mean_error": 0.3, "sd_ratio": (0.7, 1.3)}}
    mc = {"mean_excess": 0.19, "sd_ratio_allowed": (0.81, 1.24), "min_ess": 400.0}
    assert checks.verdict("DSGLD", _cell(score=raw, mc=mc)) == ("ok", "")
    over = {**mc, "mean_excess": 0.21}
    assert checks.verdict("DSGLD", _cell(score=raw, mc=over))[0] == "FAIL"
    few = {**mc, "min_ess": 399.0}
    verdict, reason = checks.verdict("DSGLD", _cell(mc=few))
    assert verdict == "FAIL" and "effective sample size 399 < 400" in reason
    warned = [{"category": "UserWarning", "message": "DSGLD: effective sample size"}]
    assert checks.verdict("DSGLD", _cell(mc=few, warnings=warned))[0] == "warned"


def test_compare_central_is_in_reference_sds():
    checks = _suite().checks
    ref = {"w": reference.Reference(np.zeros(2), np.array([1.0, 4.0]), np.zeros(2))}
    fed = {"w": np.array([[0.0, 0.0], [2.0, 4.0]])}  # means (1, 2), sds (1, 2)
    central = {"w": np.array([[0.0, 0.5], [2.0, 1.5]])}  # means (1, 1), sds (1, 0.5)
    got = checks.compare_central(fed, central, ref)
    # 4 standard errors of each coordinate's difference of two 2-draw estimates
    se = np.sqrt(np.array([1.0**2 + 1.0**2, 2.0**2 + 0.5**2]) / 2) / np.array([1, 4])
    assert got == {
        "mean_diff": 0.25,
        "sd_diff": 0.375,
        "mean_excess": pytest.approx(max(np.array([0.0, 0.25]) - 4 * se)),
        "sd_excess": pytest.approx(max(np.array([0.0, 0.375]) - 4 * se / np.sqrt(2))),
        "sd_ratio": (1.0, 4.0),
    }


def test_only_the_librarys_warnings_count():
    """A UserWarning attributed to a numpyro-fed module counts (once); one from
    elsewhere, or a DeprecationWarning, does not."""
    import warnings

    import numpyro_fed

    checks = _suite().checks
    library = str(Path(numpyro_fed.__file__).parent / "infer" / "pvi.py")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            warnings.warn_explicit("PVI: drift\nmore", UserWarning, library, 1)
        warnings.warn_explicit("x", DeprecationWarning, library, 1)
        warnings.warn_explicit("y", UserWarning, str(Path(np.__file__)), 1)
    assert checks.library_warnings(caught) == [
        {"category": "UserWarning", "message": "PVI: drift"}
    ]


@pytest.mark.slow
@pytest.mark.timeout(3 * 3600)  # the project's 900 s default cut it short
def test_full_suite_runs(tmp_path):
    """Every algorithm on every posterior (30-40 minutes on two cores)."""
    record = _suite().main(["--out", str(tmp_path / "suite.json")])
    assert all(v["within"] for v in record["nuts"].values()), record["nuts"]


@pytest.mark.parametrize("answer_objective, used", [(9.0, "answer"), (11.0, "central")])
def test_a_cell_that_misses_is_judged_against_the_better_converged_optimum(
    monkeypatch, answer_objective, used
):
    """A VI cell off its central twin is judged against the pooled ELBO converged
    from the twin's answer or from its own, whichever optimum is better (the lower
    objective): from its own answer only when that optimum is the better one."""
    from types import SimpleNamespace

    suite = _suite()
    rng = np.random.default_rng(0)
    ref = {"mu": SimpleNamespace(mean=np.zeros(()), sd=np.ones(()))}
    post = SimpleNamespace(name="toy", reference=ref, data=None)
    draws = {"mu": rng.normal(1.0, 1.0, 4000)}
    twin = {"mu": rng.normal(0.0, 1.0, 4000)}
    optima = {
        "twin params": (twin, 10.0, None, True),
        "answer params": (
            {"mu": rng.normal(1.0, 1.0, 4000)},
            answer_objective,
            None,
            True,
        ),
    }
    starts = []

    def converged_fit(family, post, key, start, n):
        starts.append(start)
        return optima[start]

    monkeypatch.setattr(suite.checks, "converged_fit", converged_fit)
    monkeypatch.setattr(suite.checks, "saa_draws", lambda post: 8000)
    monkeypatch.setattr(suite, "pooled_guide_params", lambda p, data: p + " params")
    cell = {"finite": True, "warnings": []}
    cell["central"] = suite.checks.compare_central(draws, twin, ref)
    assert not suite.checks.within_tolerance("PVI", cell)[0]
    cache = {"params": {("toy", "mean-field"): "twin params"}}
    suite._refit_central(
        cell, draws, "answer", "mean-field", post, jax.random.key(0), cache
    )
    assert starts == ["twin params", "answer params"]
    assert cell["central_refit"] == {
        "objective": {"central": 10.0, "answer": answer_objective},
        "converged": {"central": True, "answer": True},
        "draws": 8000,
        "used": used,
    }
    assert suite.checks.verdict("PVI", cell)[0] == (
        "ok" if used == "answer" else "FAIL"
    )


def test_converged_fit_reaches_the_mean_field_optimum():
    """On a conjugate normal model the mean-field optimum is the exact posterior;
    BFGS on the fixed draws reaches it from a far start, to the draws' own error."""
    from types import SimpleNamespace

    import jax.numpy as jnp
    import numpyro.distributions as dist

    import numpyro_fed as nf

    suite = _suite()

    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        with numpyro.plate("data", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    y = jnp.asarray(np.random.default_rng(1).normal(2.0, 1.0, 50))
    fed = nf.federate(model, silos="data")
    data = nf.FederatedData.from_groups(np.arange(50) % 5, y=y)
    precision = 50 + 1 / 100
    mean, sd = float(jnp.sum(y)) / precision, precision**-0.5
    ref = {"mu": SimpleNamespace(mean=np.asarray(mean), sd=np.asarray(sd))}
    post = SimpleNamespace(name="toy", fed_model=fed, data=data, reference=ref)
    start = {
        "_fed_global_loc": jnp.array([-5.0]),
        "_fed_global_scale": jnp.array([3.0]),
    }
    draws, objective, params, converged = suite.checks.converged_fit(
        "mean-field", post, jax.random.key(0), start, 16000
    )
    assert converged
    assert suite.checks.saa_draws(post) == suite.checks.SAA_DRAWS
    # the fixed draws' mean and spread move the optimum by about sd / sqrt(draws)
    assert abs(float(params["_fed_global_loc"][0]) - mean) < 4 * sd / np.sqrt(8000)
    assert abs(float(params["_fed_global_scale"][0]) / sd - 1) < 4 / np.sqrt(2 * 8000)
    assert abs(draws["mu"].mean() - mean) < 4 * sd / np.sqrt(16000) + 4 * sd / 90


def test_a_cell_on_too_much_data_keeps_its_central_twin(monkeypatch):
    """Where even the fewest fixed draws would not fit in memory (item-response
    theory), nothing is converged and the cell stays judged against its twin."""
    from types import SimpleNamespace

    suite = _suite()
    monkeypatch.setattr(suite.checks, "saa_draws", lambda post: None)
    monkeypatch.setattr(
        suite.checks, "converged_fit", lambda *a: pytest.fail("converged anyway")
    )
    cell = {"central": "twin"}
    post = SimpleNamespace(name="toy")
    suite._refit_central(cell, {}, None, "mean-field", post, None, {})
    assert cell == {
        "central": "twin",
        "central_refit": {"skipped": "too much data for a converged fit"},
    }
