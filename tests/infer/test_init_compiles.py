# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""``init`` compiles few programs (the keys and all initial states in one) and its
states are those of the server's and the silos' own initial steps."""

import contextlib

import jax
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import numpyro_fed as nf

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def count_compiles():
    """The names of the XLA programs compiled inside the block."""
    names = []

    def listener(event, duration, **kwargs):
        del duration
        if event == BACKEND_COMPILE:
            names.append(kwargs.get("fun_name"))

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield names
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)


def glmm(X, y=None):
    beta = numpyro.sample("beta", dist.Normal(0, 10).expand([X.shape[-1]]).to_event(1))
    omega = numpyro.sample("omega", dist.Normal(0, 10))
    with numpyro.plate("unit", X.shape[0]):
        b = numpyro.sample("b", dist.Normal(0, jax.numpy.exp(-omega)))
        numpyro.sample("y", dist.Bernoulli(logits=X @ beta + b), obs=y)


def _one_unit_silos(num_silos):
    rng = np.random.default_rng(num_silos)
    X = rng.normal(size=(num_silos, 3))
    y = (rng.random(num_silos) < 0.5).astype(X.dtype)
    return nf.FederatedData.from_groups(np.arange(num_silos), X=X, y=y)


GUIDES = {"structured": nf.AutoGlobalLocalNormal, "mean-field": nf.AutoMeanField}


@pytest.mark.parametrize("guide", GUIDES.values(), ids=GUIDES.keys())
def test_a_new_layout_compiles_three_programs(guide):
    """After one layout, a second one whose silos look alike (the model's own run on
    silo 0 hits the cache) compiles the silo view, the padded view and the initial
    states: three programs (every key split and each side compiled apart before)."""
    fed = nf.federate(glmm, silos="unit")
    first = nf.SFVI(fed, guide(fed), optax.adam(0.01))
    first.init(jax.random.key(0), _one_unit_silos(3))
    second = nf.SFVI(fed, guide(fed), optax.adam(0.01))
    data = _one_unit_silos(5)
    with count_compiles() as names:
        jax.block_until_ready(second.init(jax.random.key(0), data))
    assert len(names) <= 3, names
    with count_compiles() as names:  # a second init on the layout: nothing new
        second.init(jax.random.key(1), data)
    assert names == []


@pytest.mark.parametrize("guide", GUIDES.values(), ids=GUIDES.keys())
def test_init_equals_the_separate_initial_steps(guide):
    fed = nf.federate(glmm, silos="unit")
    svi = nf.SFVI(fed, guide(fed), optax.adam(0.01))
    data = _one_unit_silos(4)
    key = jax.random.key(7)
    state = svi.init(key, data)
    algorithm, _ = svi._build(data)
    next_key, server_key, silo_key = jax.random.split(key, 3)
    server = jax.jit(algorithm.init_server)(server_key)
    silos = jax.jit(jax.vmap(algorithm.init_silo))(
        jax.random.split(silo_key, data.num_silos), svi._silo_data(data)
    )
    expected = (server, silos, jax.random.key_data(next_key))
    actual = (state.server, state.silos, jax.random.key_data(state.rng_key))
    for a, b in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("progress_bar", [False, True], ids=["scan", "loop"])
def test_a_run_on_new_data_of_the_same_layout_compiles_no_round(progress_bar):
    """The run loop takes the silos' data as an argument (as NumPyro's SVI does):
    new values of the same layout reuse the compiled rounds, and the run sees them
    (it equals a fresh object's run on those data)."""
    fed = nf.federate(glmm, silos="unit")
    first, second = _one_unit_silos(6), _one_unit_silos(6)
    second = nf.FederatedData.from_groups(
        np.arange(6),
        X=-np.asarray(second.arrays["X"][:, 0]),
        y=second.arrays["y"][:, 0],
    )
    svi = nf.SFVI(fed, nf.AutoMeanField(fed), optax.adam(0.05))
    key = jax.random.key(0)
    svi.run(key, 5, first, progress_bar=progress_bar)
    state = svi.init(key, second)
    with count_compiles() as names:
        again = svi.run(key, 5, second, progress_bar=progress_bar, init_state=state)
    assert not {"jit(rounds)", "jit(step)"}.intersection(names), names
    fresh = nf.SFVI(fed, nf.AutoMeanField(fed), optax.adam(0.05))
    alone = fresh.run(key, 5, second, progress_bar=progress_bar)
    np.testing.assert_array_equal(again.losses, alone.losses)
