# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The sharded runtime equals the simulated one.

jax fixes its device count when it starts, and this process has started it with one
CPU device, so the comparisons on 4 host devices (3 silos: one inert silo of
padding) run in one fresh process, ``tests/runtime/_sharded_check.py``."""

from functools import partial
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.runtime import (
    sharded_group_round,
    sharded_round,
    silo_mesh,
    simulate_round,
)
from numpyro_fed.runtime.groups import group_round
from tests import _models as m
from tests.runtime._sharded_check import (
    GROUPINGS,
    grouped_toy_case,
    key_data,
    toy_case,
)
from tests.vertical import _fixtures as fx

ROOT = pathlib.Path(__file__).parents[2]


def _run_check(*args: str) -> None:
    flags = os.environ.get("XLA_FLAGS", "")  # the suite's compile flags, if set
    env = {
        **os.environ,
        "XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count=4".strip(),
        "JAX_PLATFORMS": "cpu",
        "JAX_ENABLE_X64": "1",
    }
    done = subprocess.run(
        [sys.executable, "-m", "tests.runtime._sharded_check", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]


def test_four_devices_equal_simulate():
    """A toy that carries a routed part, ``select``, partial participation and silo
    states, and ``SFVI(..., runtime="sharded").run``, on 4 devices."""
    _run_check()


@pytest.mark.slow
def test_four_devices_equal_simulate_for_every_algorithm():
    """Every case of the contract test (full and partial participation), and the
    driver's SFVI and PVI (partial participation), on 4 devices."""
    _run_check("--all")


def test_one_device_equals_simulate():
    algorithm, silo_data, server_key, silo_keys = toy_case()
    server = algorithm.init_server(jax.random.key(0))
    silos = jax.vmap(algorithm.init_silo)(
        jax.random.split(jax.random.key(1), 3), silo_data
    )
    args = (server, silos, silo_data, server_key, silo_keys, jnp.array([1, 1, 0], bool))
    got = jax.jit(lambda *a: sharded_round(algorithm, silo_mesh(1), *a))(*args)
    m.tree_allclose(got, simulate_round(algorithm, *args), rtol=1e-10, atol=1e-12)


def test_mesh_errors():
    with pytest.raises(ValueError, match="num_devices"):
        silo_mesh(len(jax.devices()) + 1)
    algorithm, silo_data, server_key, silo_keys = toy_case()
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with pytest.raises(ValueError, match="no axis named 'silos'"):
        sharded_round(algorithm, mesh, None, None, silo_data, server_key, silo_keys)


def test_one_device_grouped_equals_group_round():
    """Silos of different structure (3 groups, typed keys in the states), with silos
    out: the sharded grouped round is the grouped round, bit for bit."""
    algorithm, groups, args = grouped_toy_case(*GROUPINGS[0])
    participating = jnp.array([1, 0, 1, 1, 1, 0], bool)
    expected = jax.jit(partial(group_round, algorithm, groups))(*args, participating)
    sharded = partial(sharded_group_round, algorithm, silo_mesh(1), groups)
    got = jax.jit(sharded)(*args, participating)
    assert jax.tree.structure(got) == jax.tree.structure(expected)
    for x, y in zip(*map(jax.tree.leaves, key_data((got, expected))), strict=True):
        assert x.dtype == y.dtype and jnp.array_equal(x, y)
    # silo 1 was out: its state (its key included) is the one it came with
    kept = zip(*map(jax.tree.leaves, key_data((got[1][1], args[1][1]))), strict=True)
    assert all(jnp.array_equal(x, y) for x, y in kept)


def test_vertical_sfvi_takes_sharded():
    """Its parties are silos of different structure: the runtime steps each
    device's groups (runs: ``_sharded_check.py --all`` on 4 devices, and the slow
    test below)."""
    aug = nf.augment(fx.gaussian_model(), fx.RHO)
    vfl = nf.VerticalSFVI(aug, nf.VerticalFamily(), optax.adam(0.01), runtime="sharded")
    assert vfl.runtime == "sharded"
    with pytest.raises(ValueError, match="runtime must be 'simulate', 'sequential'"):
        nf.VerticalSFVI(aug, nf.VerticalFamily(), optax.adam(0.01), runtime="vmap")


@pytest.mark.slow
def test_one_device_vertical_sfvi_update_equals_simulate():
    """A round of ``VerticalSFVI(runtime="sharded")`` on one device, from the
    simulated run's state (its three equal parties in one vmapped group)."""
    aug = nf.augment(fx.gaussian_model(), fx.RHO)
    data = fx.gaussian_data(n=12)
    sim = nf.VerticalSFVI(aug, nf.VerticalFamily(), optax.adam(0.05))
    state = sim.init(jax.random.key(3), data)
    sharded = nf.VerticalSFVI(
        aug, nf.VerticalFamily(), optax.adam(0.05), runtime="sharded"
    )
    got = sharded.update_with_info(state, data)
    assert sharded.party_groups == sim.party_groups == (("a", "b", "c"),)
    m.tree_allclose(got, sim.update_with_info(state, data), rtol=1e-10, atol=1e-12)
