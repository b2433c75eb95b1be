# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
Example: a real Flower deployment of numpyro-fed on loopback
============================================================

Starts one ``flower-superlink`` and one ``flower-supernode`` per silo on 127.0.0.1,
each node reading only its own silo's ``.npz`` file (named in its
``--node-config``), submits the app in this directory with ``flwr run``, waits for
the ServerApp's result file, prints the federated posterior next to the simulate
runtime's fit of the same model and NUTS on the pooled data, and stops every
process it started (each is the leader of its own process group, which is stopped
by its id; Flower's children of those processes are in the same group).

Everything stays offline: telemetry and the update check are off, ``FLWR_HOME`` is
a temporary directory whose ``config.toml`` names the loopback SuperLink, apps'
dependencies are not installed at run time, and the interpreter's ``bin/`` is first
on ``PATH`` (the SuperNode starts ``flower-superexec`` from there).

Run: ``python examples/flower/run_loopback.py`` (``--quick`` for a short run).
"""

import argparse
import json
import os
from pathlib import Path
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import fedapp  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
from numpyro.infer import MCMC, NUTS  # noqa: E402

import numpyro_fed as nf  # noqa: E402
from numpyro_fed.protocol import silo_data_of  # noqa: E402
from numpyro_fed.util import take  # noqa: E402


def synthetic(num_silos, rows, features, seed=0):
    """Logistic-regression data: an intercept and ``features - 1`` covariates,
    silo j's covariates shifted by j/2 (non-IID silos)."""
    rng = np.random.default_rng(seed)
    X = rng.normal(size=(num_silos * rows, features))
    X[:, 1:] += np.repeat(np.arange(num_silos) / 2, rows)[:, None]
    X[:, 0] = 1.0
    w = np.linspace(-1.0, 1.0, features)
    y = rng.uniform(size=len(X)) < 1 / (1 + np.exp(-X @ w))
    groups = np.repeat(np.arange(num_silos), rows)
    return nf.FederatedData.from_groups(
        groups, X=X.astype(np.float32), y=y.astype(np.float32)
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_port(port, process, timeout=60.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{process.args[0]} exited with {process.returncode}.")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listens on 127.0.0.1:{port} after {timeout} s.")


def environment(home: Path, cache: Path | None) -> dict:
    """The processes' environment: offline, loopback, this checkout's numpyro_fed."""
    env = dict(os.environ)
    env.update(
        FLWR_TELEMETRY_ENABLED="0",
        FLWR_DISABLE_UPDATE_CHECK="1",
        FLWR_HOME=str(home),
        PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
        PYTHONPATH=os.pathsep.join(
            [str(Path(nf.__file__).resolve().parents[1]), env.get("PYTHONPATH", "")]
        ),
    )
    env.setdefault("JAX_PLATFORMS", "cpu")
    if cache is not None:
        # Each message runs in a fresh ClientApp process: compile once per node.
        env["JAX_COMPILATION_CACHE_DIR"] = str(cache)
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"
    return env


#: Where a node's ClientApp runs: in the SuperNode's own process (``inprocess.py``),
#: in one long-lived process beside it (``clientapp_worker.py``), or, as Flower
#: ships, in a new process per message.
CLIENTAPPS = ("in-process", "worker", "per-message")


class Deployment:
    """A SuperLink and one SuperNode per silo on 127.0.0.1, stopped on exit.

    :param workdir: logs, ``FLWR_HOME`` and the nodes' compilation cache go here.
    :param silo_files: one data file per silo, each named to its node only.
    :param cache: a persistent JAX compilation cache on the nodes.
    :param clientapp: one of :data:`CLIENTAPPS`.
    :param fast_poll: ``fast_supernode.py`` and ``quick_pulls.py`` (else Flower's
        SuperNode and pulls as shipped; ``"in-process"`` needs them).
    """

    def __init__(
        self,
        workdir: Path,
        silo_files: list,
        cache: bool = True,
        clientapp: str = "in-process",
        fast_poll: bool = True,
    ):
        if clientapp not in CLIENTAPPS:
            raise ValueError(
                f"clientapp must be one of {CLIENTAPPS}, not {clientapp!r}."
            )
        if clientapp == "in-process" and not fast_poll:
            raise ValueError("an in-process ClientApp runs in fast_supernode.py.")
        self.workdir, self.silo_files = workdir, silo_files
        self.clientapp, self.fast_poll = clientapp, fast_poll
        self.worker = clientapp == "worker"
        self.logs = workdir / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.home = workdir / "flwr-home"
        self.home.mkdir(exist_ok=True)
        self.env = environment(self.home, workdir / "jax-cache" if cache else None)
        if fast_poll:  # the ServerApp retries objects not yet pushed quickly too
            self.env["NUMPYRO_FED_QUICK_PULLS"] = "1"
        if clientapp == "per-message":
            # A SuperNode's SuperExec asks it for a ClientApp task every second by
            # default. (The SuperLink's asks for the ServerApp's, once a run: at
            # 0.1 s its idle requests would cost the SuperLink CPU every round.)
            self.env["FLWR_SUPEREXEC_TASK_POLL_INTERVAL"] = "0.1"
        self.processes: list[subprocess.Popen] = []
        self.started: set[int] = set()
        #: silo -> the processes that serve it (its SuperNode, its ClientApp worker)
        self.nodes: dict[int, list[subprocess.Popen]] = {}
        self.killed: set[int] = set()

    def _start(self, name, args):
        log = open(self.logs / f"{name}.log", "w")
        process = subprocess.Popen(
            args,
            env=self.env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, stopped by its id
        )
        log.close()
        self.processes.append(process)
        self.started.add(process.pid)
        return process

    def __enter__(self):
        port = free_port()
        (self.home / "config.toml").write_text(
            '[superlink]\ndefault = "loopback"\n\n[superlink.loopback]\n'
            f'address = "127.0.0.1:{port}"\ninsecure = true\n'
        )
        try:
            link = self._start(
                "superlink",
                [
                    "flower-superlink",
                    "--insecure",
                    "--disable-runtime-dependency-installation",
                    "--port",
                    str(port),
                ],
            )
            wait_for_port(port, link)
            for j, path in enumerate(self.silo_files):
                node_port = free_port()
                node = self._start(
                    f"supernode-{j}",
                    (
                        [sys.executable, str(HERE / "fast_supernode.py")]
                        if self.fast_poll
                        else ["flower-supernode"]
                    )
                    + [
                        "--insecure",
                        "--superlink",
                        f"127.0.0.1:{port}",
                        "--port",
                        str(node_port),
                        "--node-config",
                        f'silo={j} data="{path}"',
                    ]
                    # no SuperExec: the ClientApp runs in the node or a worker
                    + (["--isolation", "process"] if self.worker else [])
                    + (
                        ["--isolation", "process", "--in-process"]
                        if self.clientapp == "in-process"
                        else []
                    ),
                )
                wait_for_port(node_port, node)
                self.nodes[j] = [node]
                if self.worker:
                    worker = self._start(
                        f"clientapp-worker-{j}",
                        [
                            sys.executable,
                            str(HERE / "clientapp_worker.py"),
                            "--insecure",
                            "--runtime-api-address",
                            f"127.0.0.1:{node_port}",
                        ],
                    )
                    self.nodes[j].append(worker)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc):
        self.stop()

    @property
    def groups(self) -> list[int]:
        """The process groups started (each process leads its own)."""
        return [p.pid for p in self.processes]

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM every started process and its descendants, then SIGKILL what is
        left (Flower starts some children in sessions of their own)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = descendants(self.groups)
            for pid in pids:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, sig)
                    except (ProcessLookupError, PermissionError):
                        pass
            self.started.update(pids)
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline:
                for p in self.processes:
                    p.poll()  # reap the leaders
                if not self.left():
                    return
                time.sleep(0.1)

    def kill_node(self, silo: int) -> list[int]:
        """SIGKILL silo ``silo``'s SuperNode and ClientApp worker (each the leader
        of its own process group, started here), as a machine that dies would
        stop; their pids."""
        pids = descendants([p.pid for p in self.nodes[silo]])
        # marked first: submit(), in another thread, takes an exit it did not
        # expect for a failure of the deployment
        self.killed.update(p.pid for p in self.nodes[silo])
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for p in self.nodes[silo]:
            p.wait(timeout=10)
        return pids

    def left(self) -> list[int]:
        """The processes started here (and their children) that are still alive."""
        return sorted(p for p in descendants(sorted(self.started)) if alive(p))

    def submit(self, config: dict, result: Path, timeout: float) -> dict:
        """``flwr run`` this app with ``config``; the ServerApp's result."""
        overrides = " ".join(f"{k}={json.dumps(v)}" for k, v in config.items())
        overrides += f" result={json.dumps(str(result))}"
        subprocess.run(
            ["flwr", "run", str(HERE), "loopback", "--run-config", overrides],
            env=self.env,
            check=True,
            stdout=open(self.logs / "flwr-run.log", "w"),
            stderr=subprocess.STDOUT,
            timeout=120,
        )
        deadline = time.monotonic() + timeout
        while not result.exists():
            dead = [
                p.args[0]
                for p in self.processes
                if p.poll() is not None and p.pid not in self.killed
            ]
            if dead or time.monotonic() > deadline:
                raise RuntimeError(
                    f"no result after {timeout} s (exited: {dead}); logs: {self.logs}"
                )
            time.sleep(0.2)
        return json.loads(result.read_text())


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def descendants(pids) -> list[int]:
    """``pids`` and every live process below them (Linux ``/proc``)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (FileNotFoundError, ProcessLookupError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), list(pids)
    while todo:
        pid = todo.pop()
        if pid not in found:
            found.add(pid)
            todo.extend(children.get(pid, []))
    return sorted(p for p in found if alive(p))


def nuts(data, samples, seed=0):
    mcmc = MCMC(
        NUTS(fedapp.logistic),
        num_warmup=samples,
        num_samples=samples,
        progress_bar=False,
    )
    mcmc.run(jax.random.key(seed), **data.pooled())
    w = np.asarray(mcmc.get_samples()["w"])
    return w.mean(0), w.std(0)


def simulated(config, data, seed):
    """The same fit through the simulate runtime (one process, silos vmapped)."""
    fit = fedapp.make_fit(config["algorithm"], config["local-steps"])
    run = fit.run(jax.random.key(seed), config["num-rounds"], data, progress_bar=False)
    q = fit.get_params(run.state).eta_global
    return np.asarray(q["loc"]), np.asarray(q["scale"])


def main(args):
    rounds = args.rounds or (10 if args.quick else 40)
    config = {
        "algorithm": args.algorithm,
        "local-steps": args.local_steps,
        "num-rounds": rounds,
        "num-silos": args.silos,
        "rows-per-silo": args.rows,
        "num-features": args.features,
        "seed": args.seed,
    }
    data = synthetic(args.silos, args.rows, args.features, args.seed)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="numpyro-fed-flower-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stacked = silo_data_of(data)
    files = []
    for j in range(args.silos):  # each node gets only its own file
        files.append(workdir / f"silo-{j}.npz")
        fedapp.save_silo(files[-1], take(stacked, j))

    start = time.perf_counter()
    deployment = Deployment(
        workdir,
        files,
        cache=not args.no_cache,
        clientapp=args.clientapp,
        fast_poll=not args.slow_poll,
    )
    try:
        with deployment:
            print(
                f"SuperLink and {args.silos} SuperNodes up after "
                f"{time.perf_counter() - start:.1f} s; logs in {deployment.logs}"
            )
            start = time.perf_counter()
            result = deployment.submit(config, workdir / "result.json", args.timeout)
            wall = time.perf_counter() - start
    finally:
        left = deployment.left()
    print(
        f"{rounds} rounds of {args.algorithm} in {wall:.1f} s "
        f"(median round {np.median(result['round_seconds']):.2f} s); "
        f"processes left: {left}"
    )

    sim_loc, sim_scale = simulated(config, data, args.seed)
    nuts_mean, nuts_sd = nuts(data, 300 if args.quick else 1000, args.seed)
    loc, scale = np.asarray(result["loc"]), np.asarray(result["scale"])
    print(
        f"\n{'':6s} {'Flower mean':>11s} {'simulate':>9s} {'NUTS':>7s}   "
        f"{'Flower sd':>9s} {'simulate':>9s} {'NUTS':>7s}"
    )
    for i in range(args.features):
        print(
            f"w[{i}]   {loc[i]:11.3f} {sim_loc[i]:9.3f} {nuts_mean[i]:7.3f}   "
            f"{scale[i]:9.3f} {sim_scale[i]:9.3f} {nuts_sd[i]:7.3f}"
        )
    summary = {
        "config": config,
        "flower": {"loc": loc.tolist(), "scale": scale.tolist()},
        "simulate": {"loc": sim_loc.tolist(), "scale": sim_scale.tolist()},
        "nuts": {"mean": nuts_mean.tolist(), "sd": nuts_sd.tolist()},
        "nodes": result["nodes"],
        "round_seconds": result["round_seconds"],
        "run_seconds": wall,
        "started": sorted(deployment.started),
        "left": left,
    }
    if args.summary:
        Path(args.summary).write_text(json.dumps(summary, indent=1))
    if not args.workdir and not left:
        shutil.rmtree(workdir, ignore_errors=True)
    return summary


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    parser.add_argument("--quick", action="store_true", help="a short run")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--algorithm", default="pvi", choices=["pvi", "sfvi"])
    parser.add_argument("--local-steps", type=int, default=100)
    parser.add_argument("--silos", type=int, default=3)
    parser.add_argument("--rows", type=int, default=60)
    parser.add_argument("--features", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help="no persistent JAX compilation cache on the nodes",
    )
    parser.add_argument(
        "--clientapp",
        choices=CLIENTAPPS,
        default="in-process",
        help="where a node runs its ClientApp: in the SuperNode's process, in one "
        "long-lived process beside it, or in a new process per message (Flower's "
        "default)",
    )
    parser.add_argument(
        "--slow-poll",
        action="store_true",
        help="Flower's SuperNode (3 s between polls when idle) and its retries of "
        "objects pulled too early (1 s, doubling) as shipped",
    )
    parser.add_argument("--workdir", default=None, help="kept if given")
    parser.add_argument("--summary", default=None, help="write a JSON summary here")
    return parser.parse_args(argv)


if __name__ == "__main__":
    main(parse_args())
