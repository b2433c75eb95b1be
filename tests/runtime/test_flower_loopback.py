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
    # the SuperLink, its SuperExec and 3 SuperNodes (each runs its ClientApp)
    assert len(started) >= 5
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


@pytest.mark.slow
def test_a_killed_node_leaves_the_run_to_the_others(tmp_path):
    """SuperNode 2, which runs its ClientApp, is killed (SIGKILL, by the pid this
    test started) after round 2 of 6: the run completes with silos 0 and 1, the
    server names silo 2 and its node as missing, and no process is left."""
    from concurrent.futures import ThreadPoolExecutor
    import time

    if shutil.which("flower-superlink", path=str(Path(sys.executable).parent)) is None:
        pytest.skip("flower-superlink is not next to this interpreter")
    sys.path.insert(0, str(SCRIPT.parent))
    import fedapp
    import run_loopback

    from numpyro_fed.protocol import silo_data_of
    from numpyro_fed.util import take

    data = run_loopback.synthetic(3, 60, 4)
    files = [tmp_path / f"silo-{j}.npz" for j in range(3)]
    for j, path in enumerate(files):
        fedapp.save_silo(path, take(silo_data_of(data), j))
    progress, result = tmp_path / "progress", tmp_path / "result.json"
    config = {
        "algorithm": "pvi",
        "local-steps": 20,
        "num-rounds": 6,
        "num-silos": 3,
        "rows-per-silo": 60,
        "num-features": 4,
        "seed": 0,
        # long enough for round 0's compilation on a busy machine; a dead node's
        # messages end sooner, with the SuperLink's "node unavailable" reply
        "round-timeout": 300.0,
        "progress": str(progress),
    }
    deployment = run_loopback.Deployment(tmp_path / "run", files)
    deployment.env.pop("JAX_ENABLE_X64", None)  # the example is float32 throughout
    deployment.env["JAX_PLATFORMS"] = "cpu"
    try:
        with deployment, ThreadPoolExecutor(1) as pool:
            future = pool.submit(deployment.submit, config, result, 900.0)
            deadline = time.monotonic() + 600
            while not (progress.exists() and int(progress.read_text() or 0) >= 2):
                assert not future.done(), future.exception()
                assert time.monotonic() < deadline, "round 2 never ended"
                time.sleep(0.2)
            killed = deployment.kill_node(2)
            done_before = int(progress.read_text())
            out = future.result(timeout=900)
    finally:
        left = deployment.left()
    assert left == [] and not any(_alive(p) for p in killed)
    assert done_before < 6, "the run ended before the node was killed"
    missing = out["missing"]
    assert len(missing) == len(out["losses"]) == 6  # every round ran
    # silos 0 and 1 answered every round; silo 2 every round before the kill
    assert all(set(m) <= {"2"} for m in missing)
    assert not any(missing[:done_before])
    # silo 2 is named with its node, which served it before and is gone at the end
    named = {m["2"] for m in missing if m}
    assert len(named) == 1 and "2" not in out["nodes"]
    assert named.isdisjoint(out["nodes"].values())
    assert sorted(out["nodes"]) == ["0", "1"]
    assert np.all(np.isfinite(out["loc"])) and np.all(np.isfinite(out["losses"]))
