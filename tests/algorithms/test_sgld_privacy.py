# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The FSGLD inversion attack: from one DSGLD step with ``batch_size=1`` the server,
knowing everything in its message and the silo's reply, subtracts the step's
Langevin noise and inverts the Gaussian likelihood's gradient into the silo's data
row. It works when the server can replay the noise (``reproducible=True``: the
chain's key travels in the message) and fails in the default mode, where the silo
draws from its own key."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import pytest

import numpyro_fed as nf
from numpyro_fed.potentials import batch_indices
from numpyro_fed.protocol import silo_data_of
from numpyro_fed.util import take

H, PRIOR_SCALE = 1e-2, 10.0


def model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, PRIOR_SCALE))
    with nf.silo_plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


@pytest.fixture(scope="module")
def data():
    y = np.random.default_rng(0).normal(1.0, 2.0, size=12)
    return nf.FederatedData.from_groups(np.repeat([0, 1, 2], [4, 5, 3]), y=y)


def one_step(data, reproducible, seed):
    """One contact of one Langevin step: what the server sent, held and got back,
    and the contacted silo's data."""
    kernel = nf.DSGLD(model, H, batch_size=1, reproducible=reproducible)
    algorithm = kernel.algorithm(data)
    server = algorithm.init_server(jax.random.key(seed))
    j = int(server.silo)
    silo_data = take(silo_data_of(data), j)
    silo_state = algorithm.init_silo(jax.random.key(seed + 100), silo_data)
    message = algorithm.server_message(server, jax.random.key(seed + 200)).at(j)
    silo_key = jax.random.key(seed + 300)  # the silo's own, never sent
    reply, _ = algorithm.silo_step(message, silo_state, silo_data, silo_key)
    return server, message, reply, j, silo_data


def invert(server, message, reply, num_units, padded, silo_prob):
    """The server's attack: replay step t's draws from the key it knows, subtract
    the noise, and solve the gradient of N(y | mu, 1) for y. Returns the recovered
    row and the unit slot the server believes was drawn."""
    chain = message.broadcast
    # the chain's key if the message carries one; else the only key the server has
    key = chain.rng_key if jax.tree.leaves(chain.rng_key) else server.rng_key
    t = chain.step
    # the documented draws of step t: (silo, batch, noise) keys, then global noise
    _, k_batch, k_noise = jax.random.split(jax.random.fold_in(key, t), 3)
    theta = jnp.reshape(chain.z_global["mu"], (1,))
    noise = jax.random.normal(jax.random.split(k_noise)[0], (1,), theta.dtype)
    after = reply.trajectory["mu"][-1]
    psi = (after - theta - jnp.sqrt(H) * noise) * 2 / H
    grad_prior = -theta / PRIOR_SCALE**2
    grad_row = (psi - grad_prior) * silo_prob / num_units  # m = 1: one row
    slot = batch_indices(k_batch, num_units, padded, 1)[0]
    return float((theta + grad_row)[0]), int(slot)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replayable_noise_gives_the_row_away(data, seed):
    """The attack is real: with the chain's key in the message, one step recovers
    the silo's data row (and which row it was)."""
    server, message, reply, j, silo_data = one_step(data, True, seed)
    assert jax.tree.leaves(message.broadcast.rng_key)  # the key crossed the wire
    y_hat, slot = invert(
        server, message, reply, data.sizes[j], data.padded_size, 1 / data.num_silos
    )
    np.testing.assert_allclose(y_hat, silo_data.arrays["y"][slot], atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_private_default_keeps_the_row(data, seed):
    """By default no key crosses the wire and the silo's noise is its own: the same
    attack, with the server's own chain key, lands on none of the silo's rows."""
    server, message, reply, j, silo_data = one_step(data, False, seed)
    assert not any(
        jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)
        for leaf in jax.tree.leaves(message)
    )
    y_hat, _ = invert(
        server, message, reply, data.sizes[j], data.padded_size, 1 / data.num_silos
    )
    rows = np.asarray(silo_data.arrays["y"])[: data.sizes[j]]
    assert np.min(np.abs(rows - y_hat)) > 1e-2, (y_hat, rows)
