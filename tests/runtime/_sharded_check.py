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
from numpyro_fed.runtime import (
    sharded_group_round,
    sharded_round,
    silo_mesh,
    simulate_round,
)
from numpyro_fed.runtime.groups import group_round, stack_groups
from tests import _models as m
from tests.algorithms.test_contract import CASES, GROUPED, silo_list
from tests.vertical import _fixtures as fx

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


def grouped_toy(num_silos: int) -> FederatedAlgorithm:
    """:func:`toy` for silos of different structure: a silo's state and data have
    as many coordinates as its data have columns, and a typed key."""

    def silo_step(message, state, data, key):
        x = jnp.where(data.mask[:, None], data.arrays["x"], 0.0)
        key, noise = jax.random.split(state["key"])
        w = state["w"] + message.broadcast * jnp.sum(x, 0) + message.routed
        reply = jnp.sum(w**2) + jax.random.normal(noise) + jax.random.normal(key)
        return reply, {"w": w, "key": key, "n": state["n"] + 1}

    def init_silo(key, data):
        width = data.arrays["x"].shape[-1]
        return {"w": jnp.zeros(width), "key": key, "n": jnp.zeros((), jnp.int32)}

    base = toy(num_silos)
    return base._replace(init_silo=init_silo, silo_step=silo_step)


def grouped_toy_case(widths: tuple, groups: tuple):
    """:func:`grouped_toy` on silos in ``groups``, group ``g``'s data ``widths[g]``
    columns wide; returns ``(algorithm, groups, args)``, the states initialized."""
    num_silos = sum(len(g) for g in groups)
    per_silo: list = [None] * num_silos
    for width, group in zip(widths, groups, strict=True):
        for j in group:
            x = jnp.arange(4.0 * width).reshape(4, width) / (j + 1)
            per_silo[j] = SiloData({"x": x}, jnp.arange(4) < 2 + j % 3, jnp.arange(4))
    algorithm = grouped_toy(num_silos)
    keys = list(jax.random.split(jax.random.key(2), num_silos))
    init = list(jax.random.split(jax.random.key(1), num_silos))
    states = [algorithm.init_silo(k, d) for k, d in zip(init, per_silo, strict=True)]
    args = (
        algorithm.init_server(jax.random.key(0)),
        stack_groups(states, groups),
        stack_groups(per_silo, groups),
        jax.random.key(4),
        stack_groups(keys, groups),
    )
    return algorithm, groups, args


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


def key_data(tree):
    """``tree`` with its typed keys as their data, to compare them."""

    def data(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(x)
        return x

    return jax.tree.map(data, tree)


#: ``(widths, groups)``: 3 groups (fewer than 4 devices; silo order interleaved) and
#: 6 (more: devices 0 and 1 own two each).
GROUPINGS = (
    ((2, 3, 1), ((0, 3), (1,), (2, 4, 5))),
    ((1, 2, 3, 1, 2, 4), ((0,), (1,), (2, 6), (3,), (4,), (5,))),
)


def check_grouped(mesh, everything: bool) -> None:
    """:func:`~numpyro_fed.runtime.sharded_group_round` on silos of different
    structure equals :func:`~numpyro_fed.runtime.groups.group_round` exactly (typed
    keys in the states included), with some silos out (and, with ``everything``,
    with every silo)."""
    for widths, groups in GROUPINGS:
        algorithm, groups, args = grouped_toy_case(widths, groups)
        grouped = jax.jit(partial(group_round, algorithm, groups))
        sharded = jax.jit(partial(sharded_group_round, algorithm, mesh, groups))
        out = jnp.arange(sum(map(len, groups))) % 3 == 1
        for participating in (~out, None) if everything else (~out,):
            expected, got = grouped(*args, participating), sharded(*args, participating)
            assert jax.tree.structure(got) == jax.tree.structure(expected)
            leaves = map(jax.tree.leaves, key_data((got, expected)))
            for x, y in zip(*leaves, strict=True):
                assert x.dtype == y.dtype and jnp.array_equal(x, y), (groups, x, y)
        print(f"{len(groups)} groups: sharded == grouped", flush=True)


def check_grouped_cases(mesh, names) -> None:
    """The contract cases whose silos differ in structure, as
    :func:`check_grouped` (to float tolerance)."""
    for name in names:
        case = CASES[name]()
        algorithm, per_silo = case.algorithm, silo_list(case)
        keys = jax.random.split(jax.random.key(1), len(per_silo))
        init = jax.jit(algorithm.init_silo)
        states = [init(k, d) for k, d in zip(keys, per_silo, strict=True)]
        args = (
            jax.jit(algorithm.init_server)(jax.random.key(0)),
            stack_groups(states, case.groups),
            stack_groups(per_silo, case.groups),
            case.server_key,
            stack_groups(list(case.silo_keys), case.groups),
        )
        grouped = jax.jit(partial(group_round, algorithm, case.groups))
        sharded = jax.jit(partial(sharded_group_round, algorithm, mesh, case.groups))
        for participating in (None, PARTICIPATING):
            expected, got = grouped(*args, participating), sharded(*args, participating)
            m.tree_allclose(key_data(got), key_data(expected), **TOLERANCE)
        print(f"{name}: sharded == grouped", flush=True)


def check_vertical(kinds) -> None:
    """``VerticalSFVI(runtime="sharded").run`` equals ``runtime="simulate"``: the
    three equal parties of the Gaussian fixture (grouped, and one by one) and the
    two ragged ones of the rich fixture."""
    cases = {
        "gaussian": (fx.gaussian_model(), fx.gaussian_data(n=12), optax.adam(0.05)),
        "rich": (fx.rich_model, fx.rich_data(), optax.adam(0.02)),
    }
    for kind in kinds:
        name, vmap_parties = kind.split("-")[0], not kind.endswith("-loop")
        model, data, optim = cases[name]
        runs = [
            nf.VerticalSFVI(
                nf.augment(model, fx.RHO),
                nf.VerticalFamily(),
                optim,
                runtime=runtime,
                vmap_parties=vmap_parties,
            )
            for runtime in ("simulate", "sharded")
        ]
        results = [v.run(jax.random.key(3), 5, data, progress_bar=False) for v in runs]
        assert runs[0].party_groups == runs[1].party_groups, kind
        m.tree_allclose(results[1].state, results[0].state, **TOLERANCE)
        np.testing.assert_allclose(results[1].losses, results[0].losses, **TOLERANCE)
        print(f"VerticalSFVI {kind} {runs[1].party_groups}: sharded == simulate")


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
        fits = [make(runtime=r, **extra) for r in ("simulate", "sharded")]
        runs = [fit.run(jax.random.key(0), 4, data, **options) for fit in fits]
        if options["progress_bar"]:  # the state starts on the mesh: one compile
            assert fits[1]._built["run"][1][1]._cache_size() == 1, name
        m.tree_allclose(runs[1].state, runs[0].state, **TOLERANCE)
        np.testing.assert_allclose(runs[1].losses, runs[0].losses, **TOLERANCE)
        print(f"{name}(runtime='sharded') == simulate", flush=True)


def main(everything: bool) -> None:
    assert jax.device_count() == 4, jax.devices()
    assert jax.config.jax_enable_x64, "run with JAX_ENABLE_X64=1"
    mesh = silo_mesh()
    assert mesh.shape == {"silos": 4}, mesh
    check_second_round_compiles_nothing(mesh)
    check_grouped(mesh, everything)
    if everything:
        # silos of different structure go through sharded_group_round
        check_cases(mesh, ["toy"] + sorted(set(CASES) - GROUPED))
        check_grouped_cases(mesh, sorted(GROUPED))
        check_driver(["SFVI", "PVI"])
        check_vertical(["gaussian", "gaussian-loop", "rich"])
    else:
        check_cases(mesh, ["toy"])
        check_driver(["SFVI"])


if __name__ == "__main__":
    main(everything="--all" in sys.argv[1:])
