# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""
The Flower app of the loopback example: Bayesian logistic regression, fitted by PVI
(or SFVI) over silos that each live on their own Flower SuperNode.

``flwr run`` ships this directory to the SuperLink, which loads ``fedapp:server`` in
the ServerApp process and ``fedapp:client`` in every ClientApp process. Every process
builds the same :class:`~numpyro_fed.runtime.remote.Federation` from the run config
(the data *layout*: silo count, rows per silo, features); only a node's ClientApp
reads data, from the file its SuperNode names in ``--node-config "silo=J data=PATH"``.
"""

import json
import os
import time

_IMPORT_START = time.time()  # the app's imports are timed (see _timed)

from flwr.serverapp import ServerApp  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import numpyro  # noqa: E402
import numpyro.distributions as dist  # noqa: E402
import optax  # noqa: E402

import numpyro_fed as nf  # noqa: E402
from numpyro_fed.infer.driver import FederatedState  # noqa: E402
from numpyro_fed.protocol import SiloData  # noqa: E402
from numpyro_fed.runtime import flower  # noqa: E402

if os.environ.get("NUMPYRO_FED_QUICK_PULLS") == "1":  # see quick_pulls.py
    import quick_pulls  # noqa: E402

    quick_pulls.install()  # the ServerApp pulls the nodes' replies


def logistic(X, y=None):
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([X.shape[-1]]).to_event(1))
    with numpyro.plate("data", X.shape[0]):
        numpyro.sample("y", dist.Bernoulli(logits=X @ w), obs=y)


def make_fit(algorithm: str, local_steps: int):
    """The user class; the same on the server and on every node."""
    fed = nf.federate(logistic, silos="data")
    guide = nf.AutoMeanField(fed)
    if algorithm == "pvi":
        return nf.PVI(fed, guide, optax.adam(5e-2), local_steps=local_steps)
    if algorithm == "sfvi":
        return nf.SFVI(fed, guide, optax.adam(5e-2))
    raise ValueError(f"algorithm must be 'pvi' or 'sfvi', got {algorithm!r}.")


def layout(num_silos: int, rows: int, features: int) -> nf.FederatedData:
    """Zeros with the silos' common layout: all any process needs to agree on."""
    groups = np.repeat(np.arange(num_silos), rows)
    X = np.zeros((num_silos * rows, features), np.float32)
    y = np.zeros(num_silos * rows, np.float32)
    return nf.FederatedData.from_groups(groups, X=X, y=y)


_FITS: dict = {}


def fit_and_federation(context):
    """``(fit, federation)`` for this run's config, built once per process."""
    c = context.run_config
    names = ("algorithm", "local-steps", "num-silos", "rows-per-silo", "num-features")
    key = tuple(c[name] for name in names)
    if key not in _FITS:
        fit = make_fit(str(key[0]), int(key[1]))
        _FITS[key] = fit, fit.federation(layout(*(int(v) for v in key[2:])))
    return _FITS[key]


def make_federation(context):
    return fit_and_federation(context)[1]


# ------------------------------------------------------------- silo files
def save_silo(path, silo: SiloData) -> None:
    """One silo's padded data as an ``.npz`` file."""
    arrays = {f"arrays/{k}": np.asarray(v) for k, v in silo.arrays.items()}
    np.savez(
        path, mask=np.asarray(silo.mask), unit_ids=np.asarray(silo.unit_ids), **arrays
    )


def read_silo(path) -> SiloData:
    """The :class:`SiloData` written by :func:`save_silo`, dtypes unchanged."""
    with np.load(path) as f:
        arrays = {k.split("/", 1)[1]: jnp.asarray(f[k]) for k in f.files if "/" in k}
        return SiloData(arrays, jnp.asarray(f["mask"]), jnp.asarray(f["unit_ids"]))


def load_silo(context):
    """Runs on a node: its silo index and ONLY its own data."""
    return int(context.node_config["silo"]), read_silo(context.node_config["data"])


# ------------------------------------------------------------- the apps
server = ServerApp()


@server.main()
def main(grid, context):
    c = context.run_config
    fit, federation = fit_and_federation(context)
    stamps, progress = [], str(c["progress"])

    def on_round(t, info):
        stamps.append(time.perf_counter())
        if progress:  # rounds done, for a launcher that acts mid-run
            with open(progress + ".tmp", "w") as f:
                f.write(str(t + 1))
            os.replace(progress + ".tmp", progress)

    run = flower.serve(
        grid,
        federation,
        int(c["num-rounds"]),
        rng_key=jax.random.key(int(c["seed"])),
        node_timeout=float(c["node-timeout"]),
        round_timeout=float(c["round-timeout"]) or None,
        on_round=on_round,
    )
    params = fit.get_params(FederatedState(run.state, None, None))
    result = {
        "loc": np.asarray(params.eta_global["loc"]).tolist(),
        "scale": np.asarray(params.eta_global["scale"]).tolist(),
        "losses": [float(np.sum(info.loss)) for info in run.infos],
        "round_seconds": np.diff(stamps).tolist(),
        "nodes": {str(j): int(n) for j, n in run.nodes.items()},
        # per round, the silos (and their nodes) whose reply did not come
        "missing": [{str(j): int(n) for j, n in m.items()} for m in run.missing],
    }
    path = str(c["result"])
    with open(path + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(path + ".tmp", path)  # the launcher polls for the file


client = flower.client_app(make_federation, load_silo)


def _process_start() -> float:
    """When this process started (Linux), in ``time.time()`` seconds."""
    with open("/proc/self/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/stat") as f:
        boot = next(int(line.split()[1]) for line in f if line.startswith("btime"))
    return boot + ticks / os.sysconf("SC_CLK_TCK")


def _timed(app):
    """``app`` that appends, per message, when its process started, when this module
    finished its imports, and when the handler started and ended, as a JSON line to
    the file in ``$NUMPYRO_FED_TIMING`` (benchmarks/flower_round.py reads it)."""
    from flwr.clientapp import ClientApp

    timed = ClientApp()

    def handle(message, context):
        start = time.time()
        reply = app(message=message, context=context)
        line = {
            "node": context.node_id,
            "type": message.metadata.message_type,
            "process": _process_start(),
            "import": _IMPORT_START,
            "imported": _IMPORTED,
            "start": start,
            "end": time.time(),
        }
        with open(os.environ["NUMPYRO_FED_TIMING"], "a") as f:
            f.write(json.dumps(line) + "\n")
        return reply

    timed.query()(handle)
    timed.train()(handle)
    return timed


_IMPORTED = time.time()
if os.environ.get("NUMPYRO_FED_TIMING"):
    client = _timed(client)
