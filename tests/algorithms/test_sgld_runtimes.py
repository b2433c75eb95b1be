# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""FSGLD / DSGLD on the contract: the factories run under the generic runtimes (no
algorithm named in them) and give the MCMC kernels' chains draw for draw when the
runtimes pass the kernel's silo keys (each silo draws from its own key, folded with
the step counter), and a non-finite reply is dropped while the chain goes on."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer import MCMC
import pytest

import numpyro_fed as nf
from numpyro_fed.algorithms.sgld import FSGLDSiloMessage, dsgld, fsgld
from numpyro_fed.protocol import jit_algorithm, silo_data_of
from numpyro_fed.runtime import (
    event_round,
    event_schedule,
    sequential_round,
    simulate_round,
)
from numpyro_fed.util import take
from tests import _models as m

TAU, ROUNDS = 5, 8


@pytest.fixture(scope="module")
def hierarchical():
    rng = np.random.default_rng(5)
    y = rng.normal(size=(17, 3))
    groups = np.repeat([0, 1, 2], [7, 6, 4])  # uneven silos, locals padded to 7
    fed = nf.federate(m.normal_normal, silos="group")
    data = nf.FederatedData.from_groups(groups, y=y)
    return fed, data, nf.fit_surrogates(fed, data)


def kernel_of(name, fed, q):
    if name == "fsgld":
        return nf.FSGLD(fed, 1e-2, q, tau=TAU, batch_size=3)
    return nf.DSGLD(fed, 1e-2, tau=TAU, batch_size=3)


def factory_start(algorithm, key, data):
    """The factory's own initial states (the kernel is then started there)."""
    server = algorithm.init_server(key)
    keys = jax.random.split(key, data.num_silos)
    silos = jax.vmap(algorithm.init_silo)(keys, silo_data_of(data))
    return server, silos


def kernel_chain(kernel, key, data, server, silos, num_samples):
    mcmc = MCMC(kernel, num_warmup=0, num_samples=num_samples, progress_bar=False)
    mcmc.run(key, data, init_params={**server.z_global, **silos.z_local})
    return np.asarray(mcmc.get_samples()["mu"]), mcmc.last_state


def test_the_silos_draw_from_their_own_keys(hierarchical):
    """Other silo keys give another chain (same start, same silo schedule)."""
    fed, data, q = hierarchical
    algorithm = kernel_of("dsgld", fed, q).algorithm(data)
    server, silos = factory_start(algorithm, jax.random.key(0), data)
    silo_data = silo_data_of(data)
    ends = []
    for seed in (1, 2):
        keys = jax.random.split(jax.random.key(seed), data.num_silos)
        new, _, _ = simulate_round(
            algorithm, server, silos, silo_data, jax.random.key(3), keys
        )
        ends.append(np.asarray(new.z_global["mu"]))
    assert not np.any(ends[0] == ends[1])


@pytest.mark.parametrize("name", ["fsgld", "dsgld"])
@pytest.mark.parametrize("runtime", ["simulate", "sequential"])
@pytest.mark.parametrize("steps", [TAU, 1], ids=["visit", "step"])
def test_factory_under_generic_runtimes_is_the_kernel_chain(
    hierarchical, name, runtime, steps
):
    fed, data, q = hierarchical
    kernel = kernel_of(name, fed, q)
    pot, cfg = kernel.potential(data), kernel.config(data)
    factory = fsgld if name == "fsgld" else dsgld
    algorithm = factory(pot, cfg, steps_per_contact=steps)
    key = jax.random.key(3)
    server, silos = factory_start(algorithm, key, data)
    draws, last = kernel_chain(kernel, key, data, server, silos, ROUNDS * TAU)

    if runtime == "simulate":
        round_fn = jax.jit(partial(simulate_round, algorithm))
    else:
        round_fn = partial(sequential_round, jit_algorithm(algorithm))
    silo_data = silo_data_of(data)
    silo_keys = last.silo_keys  # the same key every round: draws fold in the step
    trajectory = []
    for _ in range(ROUNDS * TAU // steps):
        server, silos, info = round_fn(server, silos, silo_data, key, silo_keys)
        assert not np.any(info.rejected)
        trajectory.append(np.asarray(info.trajectory["mu"]))
    np.testing.assert_allclose(np.concatenate(trajectory), draws, rtol=1e-12)
    np.testing.assert_allclose(silos.z_local["b"], last.z["b"], rtol=1e-12)
    assert int(server.step) == int(last.step) == ROUNDS * TAU
    assert int(server.silo) == int(last.silo)


def test_factory_under_the_event_runtime_is_the_kernel_chain(hierarchical):
    """Passes over the silos in index order: the chain moves at the events that
    visit its silo, and its positions are the kernel's."""
    fed, data, q = hierarchical
    kernel = kernel_of("fsgld", fed, q)
    algorithm = kernel.algorithm(data)
    key = jax.random.key(7)
    server, silos = factory_start(algorithm, key, data)
    passes = 4
    draws, last = kernel_chain(
        kernel, key, data, server, silos, passes * data.num_silos * TAU
    )
    silo_data = silo_data_of(data)
    silo_keys = last.silo_keys
    run = jax.jit(partial(event_round, algorithm))
    for p in range(passes):
        schedule = event_schedule(jax.random.key(p), data.num_silos)
        server, silos, _ = run(server, silos, silo_data, schedule, silo_keys)
    t = int(server.step)
    assert t >= passes * TAU  # the chain's silo is visited at least once a pass
    np.testing.assert_allclose(server.z_global["mu"], draws[t - 1], rtol=1e-12)


def test_a_non_finite_reply_is_dropped_and_the_chain_goes_on(hierarchical):
    fed, data, q = hierarchical
    algorithm = kernel_of("fsgld", fed, q).algorithm(data)
    server, silos = factory_start(algorithm, jax.random.key(0), data)
    silo_data = silo_data_of(data)
    silo_keys = jax.random.split(jax.random.key(1), data.num_silos)
    nan = FSGLDSiloMessage({"mu": jnp.full((data.num_silos, TAU), jnp.nan)})
    everyone = jnp.ones(data.num_silos, bool)
    chosen = np.arange(data.num_silos) == int(server.silo)
    contacted = jnp.asarray(chosen)  # what a runtime passes: select's silo
    new, info = algorithm.server_step(server, nan, jax.random.key(2), contacted)
    np.testing.assert_array_equal(info.rejected, chosen)
    # A rejected visit is one that did not happen: the chain asks the silo again.
    assert float(new.z_global["mu"]) == float(server.z_global["mu"])
    assert int(new.step) == int(server.step) and int(new.silo) == int(server.silo)
    assert np.all(np.isfinite(info.trajectory["mu"]))
    # the chain's silo did not reply: nothing changes
    same, info = algorithm.server_step(server, nan, jax.random.key(2), ~everyone)
    assert not np.any(info.rejected)
    for field in ("z_global", "step", "silo"):
        jax.tree.map(
            np.testing.assert_array_equal, getattr(same, field), getattr(server, field)
        )
    # a silo whose steps went non-finite keeps its local sites
    lost = server._replace(
        z_global={"mu": jnp.full_like(server.z_global["mu"], jnp.nan)}
    )
    j = int(server.silo)
    message = algorithm.server_message(lost, jax.random.key(2)).at(j)
    old = take(silos, j)
    reply, kept = algorithm.silo_step(message, old, take(silo_data, j), silo_keys[j])
    assert not np.all(np.isfinite(reply.trajectory["mu"]))
    jax.tree.map(np.testing.assert_array_equal, kept, old)
    # and the run continues from the kept position
    server, silos, info = simulate_round(
        algorithm, new, silos, silo_data, jax.random.key(3), silo_keys
    )
    assert np.all(np.isfinite(server.z_global["mu"])) and not np.any(info.rejected)
