# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Simulation runtime: all silos in one vmapped, jit-able round."""

from typing import Any

import jax
import jax.numpy as jnp

from numpyro_fed.protocol import FederatedAlgorithm, SiloData

__all__ = ["keep_participants", "simulate_round"]


def simulate_round(
    algorithm: FederatedAlgorithm,
    server_state: Any,
    silo_states: Any,
    silo_data: SiloData,
    server_key: jax.Array,
    silo_keys: jax.Array,
    participating: jax.Array | None = None,
) -> tuple[Any, Any, Any]:
    """
    One round with every silo stepped at once under :func:`jax.vmap`.

    Pure and jit-able: wrap it in :func:`jax.jit` (the algorithm wrappers do). With
    partial participation every silo is computed (that is what vmap does) but only
    participants keep their new state and count at the server.

    :param FederatedAlgorithm algorithm: the algorithm.
    :param server_state: the server's state.
    :param silo_states: the silos' states, stacked along a leading silo axis.
    :param SiloData silo_data: the silos' data, stacked along a leading silo axis.
    :param jax.Array server_key: the round's server key.
    :param jax.Array silo_keys: one key per silo (leading silo axis).
    :param jax.Array participating: optional ``(J,)`` booleans: the silos taking part
        in this round (default: all).
    :return: ``(server_state, silo_states, info)``.
    """
    message = algorithm.server_message(server_state, server_key)
    replies, new_states = jax.vmap(algorithm.silo_step, in_axes=(None, 0, 0, 0))(
        message, silo_states, silo_data, silo_keys
    )
    # With everyone taking part, no selection is added to the round.
    if participating is not None:
        new_states = keep_participants(participating, new_states, silo_states)
    silo_states = new_states
    server_state, info = algorithm.server_step(
        server_state, replies, server_key, participating
    )
    return server_state, silo_states, info


def keep_participants(participating: jax.Array, new: Any, old: Any) -> Any:
    """Stacked silo states: the new state for participants, the old one otherwise."""

    def select(n, o):
        return jnp.where(participating.reshape((-1,) + (1,) * (n.ndim - 1)), n, o)

    return jax.tree.map(select, new, old)
