# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Contact runtime: a round that runs only the one silo ``select`` names, for
algorithms whose state travels between silos (a Markov chain handed from silo to
silo). Pure and jit-able, and unlike :func:`~numpyro_fed.runtime.simulate_round` it
computes nothing for the silos that are not contacted, so a round costs one silo step
whatever the number of silos."""

from typing import Any

import jax
import jax.numpy as jnp

from numpyro_fed.protocol import FederatedAlgorithm, SiloData
from numpyro_fed.util import take, tree_where

__all__ = ["contact_round"]


def contact_round(
    algorithm: FederatedAlgorithm,
    server_state: Any,
    silo_states: Any,
    silo_data: SiloData,
    server_key: jax.Array,
    silo_key: jax.Array,
) -> tuple[Any, Any, Any]:
    """
    One round in which the silo that ``algorithm.select`` names (exactly one) steps
    and the server steps on its reply.

    The server receives the reply in every row (rows of silos that were not contacted
    are placeholders) and ``participating`` = the selection. If ``select`` names no
    silo, no silo state changes and the server steps with no reply arriving.

    :param FederatedAlgorithm algorithm: the algorithm.
    :param server_state: the server's state.
    :param silo_states: the silos' states, stacked along a leading silo axis.
    :param SiloData silo_data: the silos' data, stacked along a leading silo axis.
    :param jax.Array server_key: the round's server key.
    :param jax.Array silo_key: the contacted silo's key.
    :return: ``(server_state, silo_states, info)``.
    """
    num_silos = silo_data.mask.shape[0]
    chosen = algorithm.select(server_state, server_key, num_silos)
    j = jnp.argmax(chosen)
    message = algorithm.server_message(server_state, server_key)
    old = take(silo_states, j)
    reply, new = algorithm.silo_step(message.at(j), old, take(silo_data, j), silo_key)
    replies = jax.tree.map(
        lambda r: jnp.broadcast_to(r, (num_silos,) + jnp.shape(r)), reply
    )
    server_state, info = algorithm.server_step(
        server_state, replies, server_key, chosen
    )
    new = tree_where(chosen[j], new, old)
    silo_states = jax.tree.map(lambda x, y: x.at[j].set(y), silo_states, new)
    return server_state, silo_states, info
