# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Simulation runtime: all silos in one vmapped, jit-able round."""

from typing import Any

import jax
import jax.numpy as jnp

from numpyro_fed.protocol import (
    FederatedAlgorithm,
    SiloData,
    select_all,
    vmap_silos,
)
from numpyro_fed.util import rows_where

__all__ = ["contacted_silos", "init_states", "simulate_round"]


def contacted_silos(
    algorithm: FederatedAlgorithm,
    server_state: Any,
    server_key: jax.Array,
    num_silos: int,
    participating: jax.Array | None,
) -> jax.Array | None:
    """The silos contacted this round: the algorithm's ``select`` and the runtime's
    participation draw together; ``None`` when that is every silo by construction
    (so a full round adds no selection to the compiled program)."""
    if algorithm.select is select_all:
        return participating
    chosen = algorithm.select(server_state, server_key, num_silos)
    return chosen if participating is None else chosen & participating


def simulate_round(
    algorithm: FederatedAlgorithm,
    server_state: Any,
    silo_states: Any,
    silo_data: SiloData,
    server_key: jax.Array,
    silo_keys: jax.Array,
    participating: jax.Array | None = None,
    *,
    step_silos: Any = vmap_silos,
    reduce: bool = True,
) -> tuple[Any, Any, Any]:
    """
    One round with every silo stepped at once under :func:`jax.vmap`.

    Pure and jit-able. Every silo is computed (that is what vmap does) but only the
    contacted ones (``select`` and ``participating``) keep their new state and count
    at the server.

    :param FederatedAlgorithm algorithm: the algorithm.
    :param server_state: the server's state.
    :param silo_states: the silos' states, stacked along a leading silo axis.
    :param SiloData silo_data: the silos' data, stacked along a leading silo axis.
    :param jax.Array server_key: the round's server key.
    :param jax.Array silo_keys: one key per silo (leading silo axis).
    :param jax.Array participating: optional ``(J,)`` booleans: the silos taking part
        in this round (default: all).
    :param step_silos: how all silos are stepped, as :func:`vmap_silos` (the sharded
        runtime spreads them over devices).
    :param bool reduce: with the default ``step_silos``, use the algorithm's
        ``reduce_silos`` when it has one (the same round to rounding, with one
        pull-back through the shared quantities instead of one per silo).
    :return: ``(server_state, silo_states, info)``.
    """
    num_silos = silo_data.mask.shape[0]
    contacted = contacted_silos(
        algorithm, server_state, server_key, num_silos, participating
    )
    message = algorithm.server_message(server_state, server_key)
    if reduce and algorithm.reduce_silos is not None and step_silos is vmap_silos:
        mask = jnp.ones((num_silos,), bool) if contacted is None else contacted
        replies, new_states = algorithm.reduce_silos(
            message, silo_states, silo_data, silo_keys, mask
        )
    else:
        replies, new_states = step_silos(
            algorithm.silo_step, message, silo_states, silo_data, silo_keys
        )
    if contacted is None:
        contacted = jnp.ones((num_silos,), bool)
    else:
        new_states = rows_where(contacted, new_states, silo_states)
    server_state, info = algorithm.server_step(
        server_state, replies, server_key, contacted
    )
    return server_state, new_states, info


def init_states(algorithm: FederatedAlgorithm, num_silos: int) -> Any:
    """
    ``init(rng_key, silo_data) -> (server_state, silo_states, next_rng_key)``: the
    server's and every silo's initial state, the silos' under :func:`jax.vmap`, from
    the keys ``jax.random.split(rng_key, 3)`` (next, server, silos). Jit it whole:
    one compiled program instead of one per key split and per side.

    :param FederatedAlgorithm algorithm: the algorithm.
    :param int num_silos: ``J``.
    """

    def init(rng_key: jax.Array, silo_data: SiloData) -> tuple[Any, Any, jax.Array]:
        rng_key, server_key, silo_key = jax.random.split(rng_key, 3)
        silo_keys = jax.random.split(silo_key, num_silos)
        server = algorithm.init_server(server_key)
        return server, jax.vmap(algorithm.init_silo)(silo_keys, silo_data), rng_key

    return init
