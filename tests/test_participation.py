# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Partial participation: a runtime option that every algorithm aggregates soundly."""

from functools import partial
from itertools import combinations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import numpyro_fed as nf
from numpyro_fed.densities import data_template
from numpyro_fed.elbo import noise_keys
from numpyro_fed.protocol import jit_algorithm, silo_data_of
from numpyro_fed.runtime import sequential_round, simulate_round
from tests import _models as m


def _sgd_sfvi(num_silos=4):
    fed = nf.federate(m.hierarchical, silos="group")
    data = nf.FederatedData.from_groups(
        np.arange(7) % num_silos, **m.hierarchical_data()
    )
    guide = nf.AutoGlobalLocalNormal(fed)
    guide.setup(data)
    algorithm = nf.sfvi(fed, guide, optax.sgd(1.0), data_template(data.silo(0)))
    server = algorithm.init_server(jax.random.key(0))
    silos = jax.vmap(algorithm.init_silo)(
        jax.random.split(jax.random.key(1), num_silos), silo_data_of(data)
    )
    return algorithm, data, server, silos


def test_expected_sfvi_gradient_equals_full_gradient():
    """Averaged over every subset of k of J silos, the rescaled step of the server is
    the full-participation step (enumeration, float64)."""
    algorithm, data, server, silos = _sgd_sfvi()
    keys = noise_keys(jax.random.key(2), 1)
    message = algorithm.server_message(server, keys)
    silo_keys = jnp.broadcast_to(keys, (4,) + keys.shape)
    replies, _ = jax.jit(jax.vmap(algorithm.silo_step, in_axes=(None, 0, 0, 0)))(
        message, silos, silo_data_of(data), silo_keys
    )
    step = jax.jit(partial(algorithm.server_step, server, replies, keys))
    full, _ = step(jnp.ones(4, bool))
    subsets = list(combinations(range(4), 2))
    total = None
    for subset in subsets:
        mask = jnp.zeros(4, bool).at[jnp.array(subset)].set(True)
        new, _ = step(mask)
        total = new if total is None else jax.tree.map(jnp.add, total, new)
    mean = jax.tree.map(lambda x: x / len(subsets), total)
    m.tree_allclose(
        (mean.theta, mean.eta_global),
        (full.theta, full.eta_global),
        rtol=1e-10,
        atol=1e-12,
    )


def test_dropped_silo_keeps_its_state_in_both_runtimes():
    algorithm, data, server, silos = _sgd_sfvi()
    keys = noise_keys(jax.random.key(3), 1)
    silo_keys = jnp.broadcast_to(keys, (4,) + keys.shape)
    mask = jnp.array([True, False, True, True])
    args = (server, silos, silo_data_of(data), keys, silo_keys, mask)
    sim = jax.jit(partial(simulate_round, algorithm))(*args)
    jitted = jit_algorithm(algorithm)  # as the sequential runtime's driver
    seq = sequential_round(jitted, *args)
    m.tree_allclose(sim, seq, rtol=1e-10, atol=1e-12)
    new_silos = sim[1]
    m.tree_allclose(
        jax.tree.map(lambda x: x[1], new_silos),
        jax.tree.map(lambda x: x[1], silos),
        rtol=0,
        atol=0,
    )
    assert not np.allclose(new_silos.eta_local["loc"][0], silos.eta_local["loc"][0])


def test_half_participation_converges_on_conjugate_model():
    """SFVI with half of the silos per round still reaches the exact posterior of a
    conjugate normal hierarchy (more slowly)."""
    rng = np.random.default_rng(0)
    y = jnp.asarray(rng.normal(size=(6, 4)) + 1.0)
    fed = nf.federate(m.normal_normal, silos="group")
    data = nf.FederatedData.from_groups(np.arange(6) % 4, y=y)
    svi = nf.SFVI(
        fed,
        nf.AutoGlobalLocalNormal(fed),
        optax.adam(optax.exponential_decay(0.05, 1000, 0.5)),
        num_particles=4,
        participation=0.5,
    )
    params = svi.run(jax.random.key(0), 6000, data, progress_bar=False).params
    mean, cov = m.normal_normal_posterior(y)
    np.testing.assert_allclose(params.eta_global["loc"][0], mean[0], atol=1e-2)
    np.testing.assert_allclose(
        data.gather_units(params.eta_local["loc"])[:, 0], mean[1:], atol=1e-2
    )
    np.testing.assert_allclose(params.eta_global["scale"][0] ** 2, cov[0, 0], rtol=3e-2)
