# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Rebuild numpyro_fed/reference/data/ from the published sources (run by hand, once).

Inputs (none is downloaded here; see numpyro_fed/reference/__init__.py for provenance):

- ``--gym``: the unpacked ``inference-gym==0.0.5`` wheel (``pip download
  inference-gym==0.0.5 --no-deps`` then unzip): ground-truth modules under
  ``inference_gym/targets/ground_truth/``.
- ``--posteriordb``: a checkout of stan-dev/posteriordb: ``radon_mn`` data and the
  ``eight_schools-eight_schools_noncentered`` reference draws.
- ``--german``: UCI ``german.data-numeric`` (1000 rows of 25 integers; commas and
  header lines are tolerated, as in the copies this was checked against).

Usage: python scripts/vendor_reference.py --gym DIR --posteriordb DIR --german FILE
"""

import argparse
import json
from pathlib import Path
import subprocess
import zipfile

import numpy as np

OUT = Path(__file__).resolve().parents[1] / "numpyro_fed" / "reference" / "data"


def _gym_values(gym: Path, target: str) -> dict:
    path = gym / "inference_gym" / "targets" / "ground_truth" / f"{target}.py"
    scope: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), scope)  # numpy arrays only
    return {k: np.asarray(v).tolist() for k, v in scope.items() if k.isupper()}


def _gym_summary(gym: Path, target: str, sites: dict) -> dict:
    """sites: our site name -> the gym's upper-case prefix after ``IDENTITY_``."""
    v = _gym_values(gym, target)
    out = {}
    for site, key in sites.items():
        out[site] = {
            "mean": v[f"IDENTITY_{key}MEAN"],
            "sd": v[f"IDENTITY_{key}STANDARD_DEVIATION"],
            "mcse": v[f"IDENTITY_{key}MEAN_STANDARD_ERROR"],
        }
    return out


def _git(repo: Path, *args: str) -> bytes:
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True
    ).stdout


def _pdb_json(repo: Path, path: str) -> tuple:
    raw = _git(repo, "show", f"HEAD:{path}")
    tmp = OUT / "_tmp.zip"
    tmp.write_bytes(raw)
    with zipfile.ZipFile(tmp) as z:
        data = json.loads(z.read(z.namelist()[0]))
    tmp.unlink()
    commit = _git(repo, "log", "-1", "--format=%H", "--", path).decode().strip()
    return data, commit


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gym", type=Path, required=True)
    p.add_argument("--posteriordb", type=Path, required=True)
    p.add_argument("--german", type=Path, required=True)
    args = p.parse_args()
    OUT.mkdir(parents=True, exist_ok=True)

    # Minnesota radon: posteriordb stores log(x + 0.1) of both activity and county
    # uranium; we undo it and keep the raw values (activity has one decimal).
    path = "posterior_database/data/data/radon_mn.json.zip"
    d, commit = _pdb_json(args.posteriordb, path)
    activity = np.round(np.exp(np.array(d["log_radon"])) - 0.1, 1)
    county = np.array(d["county_idx"]) - 1
    uppm_home = np.exp(np.array(d["log_uppm"])) - 0.1
    uppm = np.array([uppm_home[county == j][0] for j in range(d["J"])])
    assert np.allclose(uppm[county], uppm_home, rtol=1e-12)
    radon = {
        "source": f"stan-dev/posteriordb {path} (last changed in commit {commit}), "
        "inverting its log(x + 0.1) transforms",
        "county": county.tolist(),
        "floor": d["floor_measure"],
        "activity": activity.tolist(),
        "uppm": [float(f"{u:.6f}") for u in uppm],
    }
    (OUT / "radon_mn.json").write_text(json.dumps(radon, separators=(",", ":")))

    rows = []
    for line in args.german.read_text().splitlines():
        fields = line.replace(",", " ").split()
        if fields and all(f.lstrip("-").isdigit() for f in fields):
            rows.append([int(f) for f in fields])
    german = np.array(rows)
    assert german.shape == (1000, 25) and (german[:, -1] == 2).sum() == 300
    np.savetxt(OUT / "german_credit_numeric.txt", german, fmt="%d")

    # Item-response theory: the gym's 30012 (student, question, correct) triples as a
    # 400 x 100 grid, "." where a student did not answer.
    scope: dict = {}
    irt_path = (
        args.gym
        / "inference_gym"
        / "internal"
        / "datasets"
        / "synthetic_item_response_theory.py"
    )
    exec(compile(irt_path.read_text(), str(irt_path), "exec"), scope)
    grid = np.full((400, 100), ".")
    grid[scope["STUDENT_IDS"], scope["QUESTION_IDS"]] = scope["CORRECT"].astype(str)
    assert (grid != ".").sum() == 30012
    (OUT / "synthetic_irt.txt").write_text("\n".join("".join(r) for r in grid) + "\n")

    path = (
        "posterior_database/reference_posteriors/draws/draws/"
        "eight_schools-eight_schools_noncentered.json.zip"
    )
    draws, es_commit = _pdb_json(args.posteriordb, path)
    pdb_es = {}
    for site in ("mu", "tau"):
        x = np.array([chain[site] for chain in draws])  # (10 chains, 1000 draws)
        pdb_es[site] = {
            "mean": x.mean(),
            "sd": x.std(ddof=1),
            "mcse": x.std(ddof=1) / np.sqrt(x.size),
        }  # ESS ~ 10^4

    radon_sites = {
        "county_effect_mean": "COUNTY_EFFECT_MEAN_",
        "county_effect_scale": "COUNTY_EFFECT_SCALE_",
        "weight": "WEIGHT_",
        "log_radon_scale": "LOG_RADON_SCALE_",
    }
    gym = "inference-gym 0.0.5 (PyPI wheel), inference_gym/targets/ground_truth/"
    summaries = {
        "eight_schools": {
            "source": gym + "eight_schools.py",
            "globals": _gym_summary(
                args.gym,
                "eight_schools",
                {"avg_effect": "AVG_EFFECT_", "log_stddev": "LOG_STDDEV_"},
            ),
        },
        "eight_schools_noncentered": {
            "source": f"stan-dev/posteriordb {path} (commit {es_commit}): mean and "
            "sd of the 10 x 1000 reference draws, mcse = sd / sqrt(10^4)",
            "globals": {
                k: {s: float(v) for s, v in d.items()} for k, d in pdb_es.items()
            },
        },
        "radon_contextual_effects_minnesota": {
            "source": gym + "radon_contextual_effects_minnesota.py",
            "globals": _gym_summary(
                args.gym, "radon_contextual_effects_minnesota", radon_sites
            ),
        },
        "radon_contextual_effects_minnesota_halfnormal": {
            "source": gym + "radon_contextual_effects_minnesota_halfnormal.py",
            "globals": _gym_summary(
                args.gym, "radon_contextual_effects_minnesota_halfnormal", radon_sites
            ),
        },
        "synthetic_item_response_theory": {
            "source": gym + "synthetic_item_response_theory.py",
            "globals": _gym_summary(
                args.gym,
                "synthetic_item_response_theory",
                {
                    "mean_student_ability": "MEAN_STUDENT_ABILITY_",
                    "question_difficulty": "QUESTION_DIFFICULTY_",
                },
            ),
        },
        "german_credit_numeric_logistic_regression": {
            "source": gym + "german_credit_numeric_logistic_regression.py",
            "globals": _gym_summary(
                args.gym, "german_credit_numeric_logistic_regression", {"weights": ""}
            ),
        },
    }
    (OUT / "summaries.json").write_text(json.dumps(summaries, indent=1) + "\n")


if __name__ == "__main__":
    main()
