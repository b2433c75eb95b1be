# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Benchmark: the time per round of a Flower deployment vs the simulate runtime
============================================================================

The app of ``examples/flower`` (Bayesian logistic regression, 3 silos of 60 rows,
PVI with ``local_steps`` Adam steps per message) is run, in the same process and
the same run of this script, by

- (a) the simulate runtime: the round jitted, all silos vmapped (``fit.update``);
- (b) Flower's simulation engine (``run_simulation``, Ray actors that live for the
  whole run, so each node compiles once);
- (c) a real deployment on loopback: a ``flower-superlink`` and 3
  ``flower-supernode`` processes, submitted with ``flwr run``, three ways: Flower's
  defaults (a new ClientApp process per message, 3 s between a node's polls), the
  same with a persistent JAX compilation cache on the nodes, long-lived ClientApp
  processes (``examples/flower/clientapp_worker.py``) with 0.1 s polls
  (``examples/flower/fast_supernode.py``), and the ClientApp in the SuperNode's own
  process (``fast_supernode.py --in-process``; its CPU counts as the SuperNode's).

Reported: the median time per round after the first ``--warmup`` rounds, its ratio
to (a) and the overhead over (a). For (c), also the CPU seconds per timed round of
each kind of process (SuperLink, its SuperExec, the ServerApp, the SuperNodes, the
ClientApps; from ``/proc/PID/stat``), which tell the time spent computing, which
grows with the machine's load, from the time spent waiting, which does not; and
the ClientApp processes log where a message's time goes (``NUMPYRO_FED_TIMING``):
process start to Python importing the app (interpreter and Flower imports), the
app's imports (JAX, NumPyro, numpyro-fed), and the handler (building the
federation, loading the silo, compiling, the step); the rest of a round is
Flower's scheduling and transport (a long-lived process imports once: its start
and imports are those of the run's first message).

Run: ``python benchmarks/flower_round.py`` (writes
``benchmarks/results/flower_round.json``; a few minutes); ``--variants long-lived``
runs only the simulate runtime and that deployment; ``--trace DIR`` logs every
request of every loopback process (``benchmarks/flower_trace/``).
"""

import argparse
import json
import os
from pathlib import Path
import platform
import shutil
import sys
import tempfile
import threading
import time

HERE = Path(__file__).resolve().parent
APP = str(HERE.parent / "examples" / "flower")
sys.path.insert(0, APP)
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import fedapp  # noqa: E402
import flwr  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import run_loopback  # noqa: E402

import numpyro_fed as nf  # noqa: E402

# the simulation engine's Ray workers import the app and this numpyro_fed too
os.environ["PYTHONPATH"] = os.pathsep.join(
    [APP, str(Path(nf.__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
)

from numpyro_fed.protocol import silo_data_of  # noqa: E402
from numpyro_fed.runtime import flower  # noqa: E402
from numpyro_fed.util import take  # noqa: E402


def config_of(args, rounds):
    return {
        "algorithm": "pvi",
        "local-steps": args.local_steps,
        "num-rounds": rounds,
        "num-silos": 3,
        "rows-per-silo": args.rows,
        "num-features": 4,
        "seed": 0,
    }


def simulate(args, data):
    """(a) seconds per round (``update`` runs the jitted round)."""
    fit = fedapp.make_fit("pvi", args.local_steps)
    state = fit.init(jax.random.key(0), data)

    def step(state):
        return fit.update(state, data)

    for _ in range(args.warmup):
        state, loss = step(state)
    jax.block_until_ready(state)
    times = []
    for _ in range(args.repeats):
        start = time.perf_counter()
        state, loss = step(state)
        jax.block_until_ready((state, loss))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def simulation_engine(args, data, rounds):
    """(b) seconds per round of Flower's simulation engine, from the server loop."""
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    stacked = silo_data_of(data)
    config = config_of(args, rounds)
    stamps = []
    server = ServerApp()

    class Context:  # the run config that fedapp reads
        run_config = config

    @server.main()
    def main(grid, context):
        _, federation = fedapp.fit_and_federation(Context)
        flower.serve(
            grid,
            federation,
            rounds,
            rng_key=jax.random.key(0),
            on_round=lambda t, info: stamps.append(time.perf_counter()),
        )

    def load(context):
        j = int(context.node_config["partition-id"])
        return j, take(stacked, j)

    client = flower.client_app(
        lambda context: fedapp.fit_and_federation(Context)[1], load
    )
    run_simulation(
        server,
        client,
        num_supernodes=3,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0}},
    )
    return float(np.median(np.diff(stamps)[args.warmup :]))


#: Process roles of a loopback deployment, by a word of their command line.
ROLES = {
    "flower-superlink": "superlink",
    "flwr-serverapp": "serverapp",
    "flower-superexec": "superexec",
    "fast_supernode.py": "supernodes",
    "flower-supernode": "supernodes",
    "clientapp_worker.py": "clientapps",
    "flwr-clientapp": "clientapps",
}


def _cpu_seconds(pid):
    """``(role, CPU seconds of pid and its reaped children)``, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline") as f:
            words = [Path(w).name for w in f.read().split("\0")[:3]]
    except (FileNotFoundError, ProcessLookupError):
        return None
    role = next((ROLES[w] for w in words if w in ROLES), "other")
    ticks = sum(int(x) for x in fields[11:15])  # utime stime cutime cstime
    return role, ticks / os.sysconf("SC_CLK_TCK")


class CpuSampler(threading.Thread):
    """Every deployment process's CPU seconds, sampled when the server reports a
    round done (``progress`` file): the CPU of the timed rounds, per role."""

    def __init__(self, deployment, progress: Path):
        super().__init__(daemon=True)
        self.deployment, self.progress, self.done = deployment, progress, False
        self.snapshots: dict[int, dict] = {}

    def run(self):
        while not self.done:
            try:
                rounds = int(self.progress.read_text())
            except (FileNotFoundError, ValueError):
                rounds = 0
            pids = run_loopback.descendants(self.deployment.groups)
            snapshot = {pid: _cpu_seconds(pid) for pid in pids}
            self.snapshots.setdefault(rounds, snapshot)
            time.sleep(0.02)

    def per_round(self, first: int, last: int) -> dict:
        """CPU seconds per round from round ``first`` done to ``last`` done, per role
        (processes of both snapshots; a child reaped in between counts twice for its
        CPU before ``first``, which is small for the deployment's processes)."""
        a, b = self.snapshots.get(first), self.snapshots.get(last)
        if not a or not b:
            return {}
        out: dict[str, float] = {}
        for pid, now in b.items():
            if now is not None and a.get(pid) is not None:
                out[now[0]] = out.get(now[0], 0.0) + (now[1] - a[pid][1]) / (
                    last - first
                )
        return out


def loopback(args, data, rounds, **options):
    """(c) seconds per round of the loopback deployment, its processes' CPU seconds
    per round, and the ClientApps' log."""
    workdir = Path(tempfile.mkdtemp(prefix="flower-round-"))
    stacked = silo_data_of(data)
    files = []
    for j in range(3):
        files.append(workdir / f"silo-{j}.npz")
        fedapp.save_silo(files[-1], take(stacked, j))
    deployment = run_loopback.Deployment(workdir, files, **options)
    timing = workdir / "timing.jsonl"
    deployment.env["NUMPYRO_FED_TIMING"] = str(timing)
    if args.trace:  # every process logs its requests (flower_trace/sitecustomize.py)
        Path(args.trace).mkdir(parents=True, exist_ok=True)
        deployment.env["NUMPYRO_FED_TRACE"] = str(Path(args.trace).resolve())
        deployment.env["PYTHONPATH"] = os.pathsep.join(
            [str(HERE / "flower_trace"), deployment.env["PYTHONPATH"]]
        )
    config = {**config_of(args, rounds), "progress": str(workdir / "progress")}
    with deployment:
        sampler = CpuSampler(deployment, workdir / "progress")
        sampler.start()
        result = deployment.submit(config, workdir / "result.json", args.timeout)
        sampler.done = True
        sampler.join()
    left = deployment.left()
    assert not left, f"processes left: {left}"
    lines = [json.loads(line) for line in timing.read_text().splitlines()]
    shutil.rmtree(workdir, ignore_errors=True)
    train = [x for x in lines if x["type"] == "train"][3 * args.warmup :]

    def median(first, last):
        return float(np.median([x[last] - x[first] for x in train]))

    # round_seconds[i] is round i+1's; the first `warmup` rounds are not timed
    cpu = sampler.per_round(args.warmup + 1, rounds)
    return {
        "round_s": float(np.median(result["round_seconds"][args.warmup :])),
        "cpu_s": {role: round(x, 4) for role, x in sorted(cpu.items())},
        "clientapp_start_s": median("process", "import"),
        "app_imports_s": median("import", "imported"),
        "handler_s": median("start", "end"),
        "clientapp_processes": len(lines),
    }


def main(args):
    load_start = os.getloadavg()
    data = run_loopback.synthetic(3, args.rows, 4)
    rounds = args.warmup + args.rounds
    t_sim = simulate(args, data)
    rows = [{"runtime": "simulate", "round_s": t_sim}]
    chosen = args.variants.split(",")
    if "engine" in chosen:
        engine = simulation_engine(args, data, rounds)
        rows.append({"runtime": "flower simulation", "round_s": engine})
    variants = {
        "defaults": (
            "loopback, Flower defaults",
            dict(cache=False, clientapp="per-message", fast_poll=False),
        ),
        "cache": (
            "loopback, compile cache",
            dict(cache=True, clientapp="per-message", fast_poll=False),
        ),
        "long-lived": (
            "loopback, long-lived",
            dict(cache=True, clientapp="worker", fast_poll=True),
        ),
        "in-process": (
            "loopback, in-process",
            dict(cache=True, clientapp="in-process", fast_poll=True),
        ),
    }
    for key in [c for c in chosen if c != "engine"]:
        name, options = variants[key]
        rows.append({"runtime": name, **loopback(args, data, rounds, **options)})
    for row in rows:
        row["ratio"] = row["round_s"] / t_sim
        row["overhead_s"] = row["round_s"] - t_sim
    print(
        f"{'runtime':<26} {'round (s)':>10} {'ratio':>9} {'overhead (s)':>13}"
        f" {'start':>6} {'imports':>8} {'handler':>8} {'CPU s/round':>12}"
    )
    for r in rows:
        parts = [r.get(k) for k in ("clientapp_start_s", "app_imports_s", "handler_s")]
        extra = "".join(f" {p:>7.2f}s" if p is not None else f" {'':>8}" for p in parts)
        cpu = r.get("cpu_s")
        extra += f" {sum(cpu.values()):>12.3f}" if cpu else ""
        print(
            f"{r['runtime']:<26} {r['round_s']:>10.4f} {r['ratio']:>9.1f}"
            f" {r['overhead_s']:>13.3f}{extra}"
        )
    for r in rows:
        if r.get("cpu_s"):
            roles = ", ".join(f"{k} {v:.3f}" for k, v in r["cpu_s"].items())
            print(f"CPU s/round, {r['runtime']}: {roles}")
    load = os.getloadavg()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "jax": jax.__version__,
        "numpyro": numpyro.__version__,
        "flwr": flwr.__version__,
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "x64": bool(jax.config.jax_enable_x64),
        "rounds": args.rounds,
        "warmup": args.warmup,
        "local_steps": args.local_steps,
        "rows_per_silo": args.rows,
        "load_average_start": [round(x, 2) for x in load_start],
        "load_average": [round(x, 2) for x in load],
    }
    out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2))
    print(
        f"load average (1, 5, 15 min): {meta['load_average_start']} at the start,"
        f" {meta['load_average']} at the end"
    )
    print(f"saved {out}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Flower round vs simulate round")
    parser.add_argument("--rounds", type=int, default=4, help="timed rounds")
    parser.add_argument("--warmup", type=int, default=1, help="untimed first rounds")
    parser.add_argument("--repeats", type=int, default=100)
    parser.add_argument("--local-steps", type=int, default=100)
    parser.add_argument("--rows", type=int, default=60)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--variants",
        default="engine,defaults,cache,long-lived,in-process",
        help="what to run beside simulate, comma-separated: engine (the simulation "
        "engine) and the loopback variants defaults, cache, long-lived, in-process",
    )
    parser.add_argument(
        "--trace",
        default=None,
        help="a directory: every loopback process logs its Flower requests there "
        "(read with benchmarks/flower_trace/phases.py; slows the processes)",
    )
    parser.add_argument("--out", default="benchmarks/results/flower_round.json")
    main(parser.parse_args())
