# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The grouped runtime: silos of different structure, vmapped by group, equal the
plain loop; vertical SFVI (a factory, no class) runs under the generic runtimes,
which name no algorithm."""

import ast
from functools import partial
import pathlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.algorithms.vertical_sfvi import num_phases, vertical_sfvi
from numpyro_fed.protocol import FederatedAlgorithm, Message, SiloData, jit_algorithm
from numpyro_fed.runtime import sequential_round, simulate_round
from numpyro_fed.runtime.groups import group_round, stack_groups, unstack_groups
from tests.vertical import _fixtures as fx

RUNTIME = pathlib.Path(nf.__file__).parent / "runtime"


def test_runtimes_import_only_the_contract_and_name_no_algorithm():
    for path in sorted(RUNTIME.glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module.startswith(
                "numpyro_fed"
            ):
                assert node.module.split(".")[1] in ("protocol", "guard", "util", "checks", "runtime"), (
                    path.name,
                    node.module,
                )
    # ... and the algorithms, pure factories, never import a runtime or a user class.
    for path in sorted((RUNTIME.parent / "algorithms").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module.startswith(
                "numpyro_fed"
            ):
                assert node.module.split(".")[1] not in ("runtime", "infer"), (
                    path.name,
                    node.module,
                )
    text = (RUNTIME / "groups.py").read_text().lower()
    for word in ("vertical", "party", "parties", "sfvi", "aux"):
        assert word not in text, word


# ------------------------------------------------------- a toy, two structures
class Reply(NamedTuple):
    total: jax.Array


def toy() -> FederatedAlgorithm:
    """Silos whose states are dicts of different keys and shapes: each replies the
    sum of its state, its data and its routed row; the server adds the replies."""

    def silo_step(message, state, data, key):
        del key
        total = sum(jnp.sum(x) for x in jax.tree.leaves(state))
        total = total + jnp.sum(data.arrays["x"]) + message.routed
        new = jax.tree.map(lambda x: x + message.broadcast, state)
        return Reply(total), new

    def server_step(state, replies, key, participating):
        del key
        total = jnp.sum(jnp.where(participating, replies.total, 0.0))
        return state + 1.0, (total, replies.total)

    return FederatedAlgorithm(
        lambda key: jnp.zeros(()),
        None,
        lambda s, key: Message(s, jnp.arange(5.0) * 10),
        silo_step,
        server_step,
    )


def _toy_silos():
    states = [
        {"a": jnp.ones(2)},
        {"b": jnp.ones((3, 2))},
        {"a": 2 * jnp.ones(2)},
        {"b": jnp.zeros((3, 2))},
        {"c": jnp.ones(())},
    ]
    data = [
        SiloData({"x": jnp.full(4, j)}, jnp.ones(4, bool), jnp.arange(4))
        for j in range(5)
    ]
    return states, data


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_groups_vmapped_equal_the_loop_and_keep_silo_order(jit):
    states, data = _toy_silos()
    keys = jax.random.split(jax.random.key(0), 5)
    results = []
    for groups in (((0, 2), (1, 3), (4,)), ((0,), (1,), (2,), (3,), (4,))):
        fn = lambda *a, g=groups: group_round(toy(), g, *a)  # noqa: E731
        fn = jax.jit(fn) if jit else fn
        server, silos, (total, replies) = fn(
            jnp.zeros(()),
            stack_groups(states, groups),
            stack_groups(data, groups),
            jax.random.key(1),
            tuple(keys[jnp.asarray(g)] for g in groups),
        )
        results.append((server, unstack_groups(silos, groups), total, replies))
    (s1, l1, t1, r1), (s2, l2, t2, r2) = results
    assert float(s1) == float(s2) == 1.0
    expected = [2 + 0 + 0, 6 + 4 + 10, 4 + 8 + 20, 0 + 12 + 30, 1 + 16 + 40]
    assert r1.tolist() == r2.tolist() == expected
    assert float(t1) == float(t2) == sum(expected)
    for a, b in zip(l1, l2, strict=True):
        assert jax.tree.structure(a) == jax.tree.structure(b)
        assert all(
            bool(jnp.all(x == y))
            for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True)
        )


# ---------------------------------------- vertical SFVI under generic runtimes
def one_party(x, y=None):
    with nf.vertical("a"):
        beta = numpyro.sample("beta", dist.Normal(0.0, 1.5).expand([2]).to_event(1))
        with numpyro.plate("rows", x.shape[0]):
            eta = nf.contribution("a", x @ beta)
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("y", dist.Normal(eta, 0.7), obs=y)


def _vertical(model, data, kind):
    vfl = nf.VerticalSFVI(
        nf.augment(model, 0.5, kind),
        nf.VerticalFamily(hidden=(3,)),
        optax.adam(0.05),
        vmap_parties=False,
    )
    state = vfl.init(jax.random.key(0), data)
    expected = vfl.update_with_info(state, data)
    owners = vfl.structure.parties + ("server",)
    alg = vertical_sfvi(
        vfl.model,
        vfl.family,
        vfl.structure,
        {o: vfl.optim for o in owners},
        data.view("server"),
    )
    _, key, keys = vfl._round_keys(state.rng_key, len(vfl.structure.parties))
    return vfl, state, expected, alg, key, keys


def _phases(round_fn, kind, server, *args):
    """One iteration: the factory's phases in order, each a generic round."""
    for phase in range(num_phases(kind)):
        server = server._replace(phase=jnp.asarray(phase, jnp.int32))
        server, silos, info = round_fn(server, *args)
        args = (silos,) + args[1:]
        if phase == num_phases(kind) - 2:
            loss = info.loss
    return server, args[0], loss


def _assert_close(got, expected):
    (server, silos, loss), (state, info) = got, expected
    for a, b in zip(
        jax.tree.leaves((server, silos)),
        jax.tree.leaves((state.server, state.silos)),
        strict=True,
    ):
        assert jnp.allclose(a, b, rtol=1e-10, atol=1e-12)
    assert jnp.allclose(loss, info.loss, rtol=1e-12)


# Both algorithms share the factory and the runtimes; the second is the slow run.
@pytest.mark.parametrize(
    "kind", ["power", pytest.param("augmented", marks=pytest.mark.slow)]
)
def test_vertical_sfvi_runs_under_the_generic_runtimes(kind):
    """The factory built by hand (no VerticalSFVI in the loop): two parties of
    different structure under group_round (jitted; the slow case also eager over
    jitted functions, as test_groups_vmapped_equal_the_loop_and_keep_silo_order
    does on a toy), one party under simulate_round and sequential_round; each iteration
    equals VerticalSFVI's own update."""
    labels = "shared" if kind == "power" else "server"
    data = fx.rich_data(labels=labels)
    vfl, state, expected, alg, key, keys = _vertical(fx.rich_model, data, kind)
    groups = ((0,), (1,))
    silo_data = vfl._silo_data(data)
    silo_keys = tuple(keys[jnp.asarray(g)] for g in groups)
    round_fns = [jax.jit(partial(group_round, alg, groups))]
    if kind == "augmented":  # eager over jitted functions: one more compilation each
        round_fns.append(partial(group_round, jit_algorithm(alg), groups))
    for round_fn in round_fns:
        got = _phases(
            round_fn, kind, state.server, state.silos, silo_data, key, silo_keys
        )
        _assert_close(got, expected)
    # one party: its silos stack, so the plain runtimes take them
    rng = np.random.default_rng(5)
    x = rng.normal(size=(30, 2))
    y = x @ np.array([1.0, -0.5]) + 0.7 * rng.normal(size=30)
    data = nf.VerticalData(
        {"a": {"x": jnp.asarray(x)}}, {"y": jnp.asarray(y)}, labels=labels
    )
    vfl, state, expected, alg, key, keys = _vertical(one_party, data, kind)
    (silos,), (silo_data,) = state.silos, vfl._silo_data(data)
    expected = (expected[0]._replace(silos=expected[0].silos[0]), expected[1])
    for round_fn in (
        jax.jit(partial(simulate_round, alg)),
        partial(sequential_round, jit_algorithm(alg)),
    ):
        got = _phases(round_fn, kind, state.server, silos, silo_data, key, keys)
        _assert_close(got, expected)
