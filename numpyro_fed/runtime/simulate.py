# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Simulation runtime: all silos in one vmapped, jit-able round."""

from typing import Any

import jax

from numpyro_fed.protocol import FederatedAlgorithm, SiloData

__all__ = ["simulate_round"]


def simulate_round(
    algorithm: FederatedAlgorithm,
    server_state: Any,
    silo_states: Any,
    silo_data: SiloData,
    server_key: jax.Array,
    silo_keys: jax.Array,
) -> tuple[Any, Any, Any]:
    """
    One round with every silo stepped at once under :func:`jax.vmap`.

    Pure and jit-able: wrap it in :func:`jax.jit` (the algorithm wrappers do).

    :param FederatedAlgorithm algorithm: the algorithm.
    :param server_state: the server's state.
    :param silo_states: the silos' states, stacked along a leading silo axis.
    :param SiloData silo_data: the silos' data, stacked along a leading silo axis.
    :param jax.Array server_key: the round's server key.
    :param jax.Array silo_keys: one key per silo (leading silo axis).
    :return: ``(server_state, silo_states, info)``.
    """
    message = algorithm.server_message(server_state, server_key)
    replies, silo_states = jax.vmap(algorithm.silo_step, in_axes=(None, 0, 0, 0))(
        message, silo_states, silo_data, silo_keys
    )
    server_state, info = algorithm.server_step(server_state, replies, server_key)
    return server_state, silo_states, info
