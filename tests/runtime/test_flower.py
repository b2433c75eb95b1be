# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Every algorithm through Flower's simulation engine gives the server state that
runtime/simulate.py gives with the same keys (float tolerance; runtime/groups.py for
vertical SFVI, whose parties are silos of different structure; runtime/events.py for
PVI's asynchronous schedule), with the silo states kept on the nodes."""

import functools
import os
import zlib

import pytest

pytest.importorskip("flwr")
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

import jax  # noqa: E402
import numpy as np  # noqa: E402

from numpyro_fed.protocol import silo_data_of  # noqa: E402
from numpyro_fed.runtime import flower  # noqa: E402
from numpyro_fed.util import take  # noqa: E402
from tests import _models as m  # noqa: E402
from tests.algorithms.test_contract import CASES, silo_list  # noqa: E402
from tests.runtime.test_remote import (  # noqa: E402
    federation_of,
    pvi_asynchronous,
    simulated,
)

NUM_ROUNDS = 3
ROOT_SEED = 11
#: Beside the contract's cases: PVI's asynchronous schedule (passes of events).
EVENTS = "pvi_asynchronous"
NAMES = sorted(CASES) + [EVENTS]


@functools.cache
def _fit(name):
    """``(federation, each silo's data, reference data, groups)`` of a fit, built
    once per process (an actor serves every node's messages)."""
    if name == EVENTS:
        fed, data = pvi_asynchronous()
        stacked = silo_data_of(data)
        return fed, [take(stacked, j) for j in range(3)], stacked, None
    case = CASES[name]()
    per_silo = silo_list(case)
    reference = per_silo if case.groups else silo_data_of(case.data)
    return federation_of(case), per_silo, reference, case.groups


def _federation(name):
    def make(context):
        jax.config.update("jax_enable_x64", True)  # the actors are fresh processes
        return _fit(name)[0]

    return make


def _load_silo(name):
    def load(context):
        j = int(context.node_config["partition-id"])
        return j, _fit(name)[1][j]

    return load


def silo_roots(name):
    """The silos' root keys as the nodes derive them from ``root_key``."""
    roots = jax.random.split(jax.random.key(ROOT_SEED), 3)
    return jax.vmap(lambda r: jax.random.fold_in(r, zlib.crc32(name.encode())))(roots)


def node_root(context):
    """A node's ``root_key``: its partition's share of ``ROOT_SEED``."""
    j = int(context.node_config["partition-id"])
    return jax.random.split(jax.random.key(ROOT_SEED), 3)[j]


@pytest.fixture(scope="module")
def flower_runs():
    """Every case as a named fit, one after another, in ONE simulation (the engine
    starts Ray and its actors once)."""
    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    runs = {}
    server = ServerApp()

    @server.main()
    def main(grid, context):
        for name in NAMES:
            fed = _federation(name)(context)
            rounds = NUM_ROUNDS * fed.exchanges
            runs[name] = flower.serve(
                grid, fed, rounds, name=name, rng_key=jax.random.key(5)
            )

    fits = {name: (_federation(name), _load_silo(name)) for name in NAMES}
    client = flower.client_app(fits=fits, root_key=node_root)
    run_simulation(
        server,
        client,
        num_supernodes=3,
        backend_config={"client_resources": {"num_cpus": 2, "num_gpus": 0}},
    )
    assert sorted(runs) == sorted(NAMES), "the server app did not finish"
    return runs


# One Flower simulation for every algorithm: a minute, most of it Ray starting and the
# engine polling, so it runs with the fault simulations (`make test-flower`, in CI).
@pytest.mark.flower
@pytest.mark.parametrize("name", NAMES)
def test_flower_simulation_equals_simulate(flower_runs, name):
    run = flower_runs[name]
    fed, _, reference, groups = _fit(name)
    sim, infos = simulated(
        fed,
        reference,
        silo_roots(name),
        jax.random.key(5),
        NUM_ROUNDS * fed.exchanges,
        lambda t: np.ones(fed.num_silos, bool),
        groups,
    )
    assert sorted(run.nodes) == [0, 1, 2]
    m.tree_allclose(run.state, sim, rtol=1e-6, atol=1e-8)
    for a, b in zip(run.infos, infos, strict=True):
        m.tree_allclose(a.loss, b.loss, rtol=1e-6, atol=1e-8)


def test_a_new_run_refuses_a_directory_that_holds_checkpoints(tmp_path):
    """Checked before any node is contacted (here there is no grid at all)."""
    import jax.numpy as jnp

    from numpyro_fed.runtime.checkpoint import CheckpointError, save_checkpoint

    save_checkpoint(tmp_path, {"x": jnp.zeros(1)}, step=2)
    fed = federation_of(CASES["dsgld"]())
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        flower.serve(None, fed, 3, checkpoint_every=1, checkpoint_dir=str(tmp_path))
    with pytest.raises(ValueError, match="need a checkpoint_dir"):
        flower.serve(None, fed, 3, resume=True)


@pytest.mark.parametrize("limit", [flower.PACK_LIMIT, 0])
def test_records_give_back_the_flat_dict_exactly(monkeypatch, limit):
    """Packed in one ConfigRecord (the default for small dicts) or, past the limit,
    as an ArrayRecord: the same names, shapes, dtypes and bits."""
    from flwr.app import ArrayRecord, ConfigRecord
    import ml_dtypes

    monkeypatch.setattr(flower, "PACK_LIMIT", limit)
    rng = np.random.default_rng(0)
    flat = {
        "['loc']": rng.normal(size=(3, 2)).astype(np.float32),
        "['scale'][0]": np.float64(np.pi).reshape(()),
        "['key']": np.array([7, 2**32 - 1], np.uint32),
        "['mask']": np.array([True, False, True]),
        "['empty']": np.zeros((0, 4), np.int64),
        "['strided']": np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2],
        "['big endian']": np.arange(3, dtype=">f8"),
    }
    if limit:  # Flower's Array (np.save) loses ml_dtypes' types; the packing keeps them
        flat["['bf16']"] = np.array([1.5, -2.0], ml_dtypes.bfloat16)
    record = flower.to_record(flat)
    assert isinstance(record, ConfigRecord if limit else ArrayRecord)
    back = flower.from_record(record)
    assert list(back) == list(flat)
    for name, x in flat.items():
        assert back[name].dtype == x.dtype and back[name].shape == x.shape, name
        assert back[name].tobytes() == np.asarray(x).tobytes(), name


def test_a_packed_record_refuses_objects_and_trailing_bytes():
    with pytest.raises(TypeError, match="field a has dtype object"):
        flower.to_record({"a": np.array([None])})
    record = flower.to_record({"a": np.zeros(2, np.float32)})
    record[flower.DATA] = record[flower.DATA] + b"\0"
    with pytest.raises(ValueError, match="1 bytes too many"):
        flower.from_record(record)
