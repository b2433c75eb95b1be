# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Faults on Flower's simulation engine, all in one simulation: a node that fails
for two rounds and comes back, a straggler past the round timeout, a node whose
replies are not finite, and a node whose reply does not match the template. Each run
is compared with the simulated run in which those silos did not take part."""

import functools
import os
import tempfile
import time
import warnings

import pytest

pytest.importorskip("flwr")
pytestmark = pytest.mark.flower
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from numpyro_fed.guard import SiloFailure  # noqa: E402
from numpyro_fed.protocol import silo_data_of  # noqa: E402
from numpyro_fed.runtime import flower  # noqa: E402
from numpyro_fed.runtime.codec import TemplateMismatch  # noqa: E402
from numpyro_fed.util import all_finite, take  # noqa: E402
from tests import _models as m  # noqa: E402
from tests.algorithms.test_contract import CASES  # noqa: E402
from tests.runtime.test_flower import node_root, silo_roots  # noqa: E402
from tests.runtime.test_remote import federation_of, simulated  # noqa: E402

# The straggler comes last: its node sleeps past the end of the simulation.
FAULTS = ("crash", "nonfinite", "malformed", "resume", "straggler")
ROUNDS = {"crash": 4, "straggler": 2, "nonfinite": 2, "malformed": 2, "resume": 4}
CHECKPOINTS = tempfile.mkdtemp(prefix="numpyro-fed-flower-")


def _silo_data(name):
    """Every silo's data; silo 0's overflow (NaN replies) in the "nonfinite" fit."""
    data = silo_data_of(CASES["sfvi"]().data)
    return CASES["sfvi"]().poison(data, 0) if name == "nonfinite" else data


@functools.cache
def _shared():
    return federation_of(CASES["sfvi"]())


def _federation(context):
    # One federation for every fit: compiled once, so round 0 fits in the timeout.
    jax.config.update("jax_enable_x64", True)
    return _shared()


def _loader(name):
    def load(context):
        j = int(context.node_config["partition-id"])
        return j, take(_silo_data(name), j)

    return load


def _faulty_client():
    from flwr.clientapp import ClientApp

    inner = flower.client_app(
        fits={name: (_federation, _loader(name)) for name in FAULTS},
        root_key=node_root,
        checkpoint_dir=lambda ctx: os.path.join(
            CHECKPOINTS, f"node{ctx.node_config['partition-id']}"
        ),
    )
    app = ClientApp()

    @app.query()
    def query(message, context):
        return inner(message, context)

    @app.train()
    def train(message, context):
        j = int(context.node_config["partition-id"])
        config = message.content["content"]  # a small message packs its config
        name, t = str(config["name"]), int(config["round"])
        if name == "crash" and j == 1 and t in (1, 2):
            raise RuntimeError("node lost")
        if name == "straggler" and j == 2 and t == 1:
            time.sleep(30.0)
        reply = inner(message, context)
        if name == "malformed" and j == 1 and t == 1:
            flat = flower.from_record(reply.content["content"])
            del flat[sorted(flat)[0]]
            reply.content["content"] = flower.to_record(flat)
        return reply

    return app


@pytest.fixture(scope="module")
def runs():
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    out = {}
    server = ServerApp()

    @server.main()
    def main(grid, context):
        for name in FAULTS:
            if name == "resume":
                out[name] = _killed_and_resumed(grid, context)
                continue
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    out[name] = flower.serve(
                        grid,
                        _federation(context),
                        ROUNDS[name],
                        name=name,
                        rng_key=jax.random.key(5),
                        round_timeout=12.0 if name == "straggler" else 120.0,
                    )
                except (TemplateMismatch, SiloFailure) as error:
                    out[name] = error
            out[name + "/warnings"] = [str(w.message) for w in caught]

    run_simulation(
        server,
        _faulty_client(),
        num_supernodes=3,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0}},
    )
    assert all(name in out for name in FAULTS), "the server app did not finish"
    return out


def _killed_and_resumed(grid, context):
    """The server dies after round 2 (its last checkpoint: after round 1), the nodes
    have gone past it; a new server resumes and the nodes go back to their own
    checkpoints."""

    def die(t, info):
        if t == 2:
            raise KeyboardInterrupt

    options = dict(
        name="resume",
        rng_key=jax.random.key(5),
        checkpoint_every=2,
        checkpoint_dir=os.path.join(CHECKPOINTS, "server"),
    )
    try:
        flower.serve(grid, _federation(context), 4, on_round=die, **options)
    except KeyboardInterrupt:
        pass
    return flower.serve(grid, _federation(context), 4, resume=True, **options)


def _expected(name, absent):
    fed = federation_of(CASES["sfvi"]())
    return simulated(
        fed,
        _silo_data(name),
        silo_roots(name),
        jax.random.key(5),
        ROUNDS[name],
        lambda t: np.arange(3) != absent.get(t, -1),
    )


def test_a_node_that_fails_is_left_out_and_rejoins(runs):
    sim, infos = _expected("crash", {1: 1, 2: 1})
    m.tree_allclose(runs["crash"].state, sim, rtol=1e-6, atol=1e-8)
    assert sorted(runs["crash"].nodes) == [0, 1, 2]  # back for round 3
    node = runs["crash"].nodes[1]  # named as missing in the rounds it failed
    assert runs["crash"].missing == [{}, {1: node}, {1: node}, {}]


def test_a_straggler_past_the_timeout_is_dropped(runs):
    sim, _ = _expected("straggler", {1: 2})
    m.tree_allclose(runs["straggler"].state, sim, rtol=1e-6, atol=1e-8)
    assert runs["straggler"].missing == [{}, {2: runs["straggler"].nodes[2]}]


def test_non_finite_replies_are_rejected_named_and_do_not_touch_the_state(runs):
    """Silo 0 replies NaN in every round: the run stops at its end naming silo 0
    and its node, with the state (which it never touched) in the error."""
    error = runs["nonfinite"]
    assert isinstance(error, SiloFailure) and error.silos == [0]
    assert "silo 0 (node" in str(error)
    run = error.result
    assert bool(all_finite(run.state))
    assert [np.asarray(i.rejected).tolist() for i in run.infos] == [
        [True, False, False]
    ] * 2
    sim, _ = _expected("nonfinite", {})
    m.tree_allclose(run.state, sim, rtol=1e-6, atol=1e-8)
    assert any("silo 0 (node" in w for w in runs["nonfinite/warnings"])


def test_a_malformed_reply_stops_the_run_naming_node_and_field(runs):
    error = runs["malformed"]
    assert isinstance(error, TemplateMismatch)
    text = str(error)
    assert "round 1: silo 1's reply lacks field" in text
    assert "silo 1 on node" in text and "nothing was applied" in text


def test_a_killed_server_resumes_from_checkpoints_with_the_nodes(runs):
    run = runs["resume"]
    assert len(run.infos) == 2  # rounds 2 and 3, after the checkpoint of round 2
    sim, _ = _expected("resume", {})
    m.tree_allclose(run.state, sim, rtol=1e-6, atol=1e-8)
    assert sorted(os.listdir(os.path.join(CHECKPOINTS, "node0", "resume"))) == [
        "checkpoint-000000002.npz",
        "checkpoint-000000004.npz",
    ]
