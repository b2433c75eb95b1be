# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""examples/flower/run_loopback.py: a SuperLink and 3 SuperNodes on 127.0.0.1, each
node with only its own silo's file, give the posterior of the simulate runtime, and
no process the script started is left."""

import json
import os
from pathlib import Path
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("flwr")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "flower" / "run_loopback.py"


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_loopback_deployment(tmp_path):
    if shutil.which("flower-superlink", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("flower-superlink is not next to this interpreter")
    summary = tmp_path / "summary.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("JAX_ENABLE_X64", None)  # the example is float32 throughout
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--quick",
            "--silos",
            "3",
            "--workdir",
            str(tmp_path / "run"),
            "--summary",
            str(summary),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = json.loads(summary.read_text())
    started = out["started"]
    # the SuperLink, 3 SuperNodes, their ClientApp workers and Flower's children
    assert len(started) >= 7
    assert out["left"] == [] and not any(_alive(p) for p in started)
    # three different nodes served the three silos, each from its own file
    assert sorted(out["nodes"]) == ["0", "1", "2"]
    assert len(set(out["nodes"].values())) == 3
    # PVI's fixed point: the deployment's q equals the simulate runtime's up to
    # the Monte Carlo noise of the local solves (different keys on the nodes)
    flower, simulate, nuts = out["flower"], out["simulate"], out["nuts"]
    sd = np.asarray(nuts["sd"])
    assert np.all(np.isfinite(flower["loc"]))
    np.testing.assert_array_less(
        np.abs(np.subtract(flower["loc"], simulate["loc"])), 0.5 * sd
    )
    np.testing.assert_allclose(flower["scale"], simulate["scale"], rtol=0.3)
    # and the fit moved from the prior N(0, 1): two coefficients are far from 0
    assert np.sum(np.abs(flower["loc"]) > 0.8) == 2
    np.testing.assert_array_less(
        np.abs(np.subtract(flower["loc"], nuts["mean"])), 0.5 * sd
    )
