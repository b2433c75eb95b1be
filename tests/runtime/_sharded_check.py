# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The sharded runtime against the simulated one, on 4 host devices.

Run by ``test_sharded.py`` as ``python -m tests.runtime._sharded_check`` in a fresh
process whose ``XLA_FLAGS`` ask for 4 CPU devices (the device count is fixed when
jax starts, and the test process has started it with one) and with
``JAX_ENABLE_X64=1``. Exits non-zero, with the failing comparison on stderr, on any
mismatch. Importing it changes nothing (``toy_case`` serves the in-process test)."""

from functools import partial
import sys
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np
import optax

import numpyro_fed as nf
from numpyro_fed.protocol import (
    FederatedAlgorithm,
    Message,
    SiloData,
    silo_data_of,
)
from numpyro_fed.runtime import sharded_round, silo_mesh, simulate_round
from tests import _models as m
from tests.algorithms.test_contract import CASES, GROUPED

TOLERANCE = {"rtol": 1e-10, "atol": 1e-12}
#: Silo 1 is out: the runtime's participation, on top of the algorithm's select.
PARTICIPATING = jnp.array([True, False, True])


class Info(NamedTuple):
    loss: jax.Array
    rejected: jax.Array
    replies: jax.Array


def toy(num_silos: int) -> FederatedAlgorithm:
    """Everything a runtime must carry, in a program that compiles in a second: a
    routed part, a ``select`` that skips a random silo, silo states, typed keys, a
    scan inside the silo step that starts from a constant, int and float leaves."""

    def server_message(state, key):
        del key
        return Message(state["theta"], state["theta"] * jnp.arange(1.0, num_silos + 1))

    def silo_step(message, state, data, key):
        y = jnp.sum(jnp.where(data.mask, data.arrays["y"], 0.0))

        def local(carry, _):
            return carry + message.broadcast * y + message.routed, None

        total, _ = lax.scan(local, jnp.zeros(()), None, length=3)
        reply = total + jax.random.normal(key)
        return reply, {"sum": state["sum"] + reply, "n": state["n"] + 1}

    def server_step(state, replies, key, participating):
        del key
        weights = jnp.where(participating, jnp.arange(1.0, num_silos + 1), 0.0)
        loss = jnp.sum(weights * replies)
        new = {"theta": state["theta"] + 1e-3 * loss, "count": state["count"] + 1}
        return new, Info(loss, jnp.zeros_like(participating), replies)

    def select(state, key, n):
        del state
        return jnp.arange(n) != jax.random.randint(key, (), 0, n)

    return FederatedAlgorithm(
        lambda key: {"theta": jnp.ones(()), "count": jnp.zeros((), jnp.int32)},
        lambda key, data: {"sum": jnp.zeros(()), "n": jnp.zeros((), jnp.int32)},
        server_message,
        silo_step,
        server_step,
        select,
    )


def toy_case():
    num_silos, units = 3, 5
    y = jnp.arange(num_silos * units, dtype=jnp.float64).reshape(num_silos, units)
    mask = jnp.arange(units) < jnp.array([[5], [3], [4]])
    data = SiloData({"y": y}, mask, jnp.where(mask, 0, -1))
    keys = jax.random.split(jax.random.key(2), num_silos)
    return toy(num_silos), data, jax.random.key(4), keys


def _prepared(name):
    if name == "toy":
        algorithm, silo_data, server_key, silo_keys = toy_case()
    else:
        case = CASES[name]()
        assert case.data.num_silos == 3, name
        algorithm, silo_data = case.algorithm, silo_data_of(case.data)
        server_key, silo_keys = case.server_key, case.silo_keys
    server = jax.jit(algorithm.init_server)(jax.random.key(0))
    keys = jax.random.split(jax.random.key(1), 3)
    silos = jax.jit(jax.vmap(algorithm.init_silo))(keys, silo_data)
    return algorithm, (server, silos, silo_data, server_key, silo_keys)


def check_cases(mesh, names) -> None:
    """Each case, with every silo and with silo 1 out, 3 silos on 4 devices (one
    inert silo of padding)."""
    for name in names:
        algorithm, args = _prepared(name)
        simulated = jax.jit(partial(simulate_round, algorithm))
        sharded = jax.jit(partial(sharded_round, algorithm, mesh))
        for participating in (None, PARTICIPATING):
            expected = simulated(*args, participating)
            got = sharded(*args, participating)
            m.tree_allclose(got, expected, **TOLERANCE)
            assert jax.tree.structure(got) == jax.tree.structure(expected), name
        # The silo side really is split: the replies are gathered across devices.
        text = sharded.lower(*args).compile().as_text()
        assert "all-gather" in text, name
        print(f"{name}: sharded == simulated", flush=True)


def check_second_round_compiles_nothing(mesh) -> None:
    """With its inputs on the mesh (as the docstring says), the next round reuses
    the compiled one: the outputs come back with the same placement."""
    algorithm, args = _prepared("toy")
    args = jax.device_put(args, NamedSharding(mesh, PartitionSpec()))
    round_fn = jax.jit(partial(sharded_round, algorithm, mesh))
    server, silos, _ = round_fn(*args)
    size = round_fn._cache_size()
    round_fn(server, silos, *args[2:])
    assert round_fn._cache_size() == size == 1
    print("second round compiles nothing", flush=True)


def check_driver(names) -> None:
    """``runtime="sharded"`` in the driver: a scanned SFVI run and a looped PVI run
    with partial participation equal their simulated runs."""
    arrays = m.logistic_data(num_rows=30)
    fed = nf.federate(m.logistic, silos="data")
    data = nf.FederatedData.from_groups(np.arange(30) % 3, **arrays)
    classes = {
        "SFVI": (
            lambda **kw: nf.SFVI(fed, nf.AutoMeanField(fed), optax.adam(0.05), **kw),
            {"progress_bar": False},
        ),
        "PVI": (
            lambda **kw: nf.PVI(fed, local_optim=optax.adam(0.05), **kw),
            {"progress_bar": True},
        ),
    }
    for name in names:
        make, options = classes[name]
        extra = {} if name == "SFVI" else {"participation": 2 / 3}
        runs = [
            make(runtime=runtime, **extra).run(jax.random.key(0), 4, data, **options)
            for runtime in ("simulate", "sharded")
        ]
        m.tree_allclose(runs[1].state, runs[0].state, **TOLERANCE)
        np.testing.assert_allclose(runs[1].losses, runs[0].losses, **TOLERANCE)
        print(f"{name}(runtime='sharded') == simulate", flush=True)


def main(everything: bool) -> None:
    assert jax.device_count() == 4, jax.devices()
    assert jax.config.jax_enable_x64, "run with JAX_ENABLE_X64=1"
    mesh = silo_mesh()
    assert mesh.shape == {"silos": 4}, mesh
    check_second_round_compiles_nothing(mesh)
    if everything:
        # silos of different structure cannot be sharded along one silo axis
        check_cases(mesh, ["toy"] + sorted(set(CASES) - GROUPED))
        check_driver(["SFVI", "PVI"])
    else:
        check_cases(mesh, ["toy"])
        check_driver(["SFVI"])


if __name__ == "__main__":
    main(everything="--all" in sys.argv[1:])
