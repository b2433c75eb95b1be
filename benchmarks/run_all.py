# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Every benchmark, quickly, in one table of ratios (``make bench``)
=================================================================

Runs each round benchmark with short settings, one after another in fresh processes
(so that one's compilation cache does not help another), and prints one table: each
federated quantity as a ratio to its anchor measured in the same process (a
centralized NumPyro SVI step, a pooled SGLD step). The benchmarks' own JSON files go
to ``--out-dir`` (default ``benchmarks/results/quick/``, so that the full runs' files
in ``benchmarks/results/`` are kept); the table is saved as ``summary.json`` there.
Wall-clock times depend on the machine and its load; the ratios are the result.

Run: ``python benchmarks/run_all.py`` (add ``--flower`` for the Flower simulation
engine and loopback rounds, which take minutes).
"""

import argparse
import json
import os
from pathlib import Path
import subprocess
import sys
import time

HERE = Path(__file__).parent


def _runs(out: Path, flower: bool) -> list[tuple[str, list[str]]]:
    runs = [
        ("sfvi_round", ["--num-silos", "100", "1000", "--repeats", "60"]),
        ("pvi_round", ["--num-silos", "10", "100", "--local-steps", "10"]),
        ("fsgld_step", ["--quick", "--step-cost-only"]),
        ("vertical_round", ["--repeats", "60"]),
    ]
    if flower:
        runs.append(("flower_round", ["--rounds", "2"]))
    return [(name, args + ["--out", str(out / f"{name}.json")]) for name, args in runs]


def _rows(name: str, result: dict) -> list[tuple[str, str, float]]:
    """``(measure, anchor, ratio)`` rows from one benchmark's JSON."""
    rows = []
    if name == "sfvi_round":
        for r in result["results"]:
            for mode in ("call", "scan"):
                rows.append(
                    (
                        f"SFVI round, GLMM, {r.get('guide', 'structured')}, "
                        f"J = {r['num_silos']} ({mode})",
                        "NumPyro SVI step",
                        r[f"{mode}_ratio"],
                    )
                )
    elif name == "pvi_round":
        for r in result["results"]:
            rows.append(
                (
                    f"PVI round, J = {r['num_silos']}, {r['local_steps']} local steps",
                    f"{r['local_steps']} NumPyro SVI steps",
                    r["ratio"],
                )
            )
    elif name == "fsgld_step":
        for r in result["step_cost"]:
            for kind in ("dsgld", "fsgld_full", "fsgld_diag"):
                rows.append(
                    (
                        f"{kind.upper().replace('_', ' ')} step, J = {r['num_silos']}",
                        "pooled SGLD step",
                        r[f"{kind}_ratio"],
                    )
                )
    elif name == "vertical_round":
        for r in result["round_vs_svi"]:
            rows.append(
                (
                    f"vertical SFVI round, n = {r['n']} ({r['aux']})",
                    "NumPyro SVI step",
                    r["ratio"],
                )
            )
    elif name == "flower_round":
        for r in result["results"][1:]:
            rows.append((f"Flower round: {r['runtime']}", "simulate round", r["ratio"]))
    return rows


def main(args) -> int:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
    table, failed = [], []
    for name, argv in _runs(out, args.flower):
        start = time.perf_counter()
        print(f"-- {name} {' '.join(argv)}", flush=True)
        done = subprocess.run(
            [sys.executable, str(HERE / f"{name}.py"), *argv],
            env=env,
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - start
        if done.returncode != 0:
            failed.append(name)
            print(done.stdout[-2000:], done.stderr[-4000:], sep="\n")
            continue
        result = json.loads((out / f"{name}.json").read_text())
        rows = _rows(name, result)
        table += [
            {
                "benchmark": name,
                "measure": m,
                "anchor": a,
                "ratio": r,
                "seconds": seconds,
            }
            for m, a, r in rows
        ]
    width = max((len(row["measure"]) for row in table), default=10)
    print(f"\n{'measure':<{width}}  {'ratio':>7}  anchor")
    for row in table:
        print(f"{row['measure']:<{width}}  {row['ratio']:>7.2f}  {row['anchor']}")
    (out / "summary.json").write_text(
        json.dumps({"rows": table, "failed": failed}, indent=2)
    )
    print(f"saved {out / 'summary.json'}")
    if failed:
        print(f"FAILED: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="every benchmark, one table of ratios")
    parser.add_argument("--out-dir", default=str(HERE / "results" / "quick"))
    parser.add_argument("--flower", action="store_true", help="Flower rounds too")
    sys.exit(main(parser.parse_args()))
