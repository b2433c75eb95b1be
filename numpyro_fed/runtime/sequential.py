# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Sequential runtime: one silo at a time, as a real deployment would run them.

Each silo sees only its own slice of the data and state; the server sees only the
messages. This is the template for distributed runtimes and the reference that the
vmapped simulation is tested against.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.protocol import FederatedAlgorithm, SiloData

__all__ = ["sequential_round"]


def _slice(tree: Any, j: int) -> Any:
    return jax.tree.map(lambda x: x[j], tree)


def _stack(trees: list) -> Any:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def sequential_round(
    algorithm: FederatedAlgorithm,
    server_state: Any,
    silo_states: Any,
    silo_data: SiloData,
    server_key: jax.Array,
    silo_keys: jax.Array,
    participating: Any = None,
) -> tuple[Any, Any, Any]:
    """
    One round with the silos stepped one after another (a Python loop); silos that
    do not participate are not contacted.

    Takes and returns the same stacked layout as
    :func:`~numpyro_fed.runtime.simulate_round`, so the two are interchangeable.

    :return: ``(server_state, silo_states, info)``.
    """
    num_silos = silo_data.mask.shape[0]
    if participating is None:
        participating = np.ones(num_silos, bool)
    participating = np.asarray(participating)
    message = algorithm.server_message(server_state, server_key)
    replies, new_states = [], []
    for j in range(num_silos):
        state, data = _slice(silo_states, j), _slice(silo_data, j)
        if participating[j]:
            reply, state = algorithm.silo_step(message, state, data, silo_keys[j])
        else:  # nothing was sent: a placeholder that the server ignores
            shapes = jax.eval_shape(
                algorithm.silo_step, message, state, data, silo_keys[j]
            )[0]
            reply = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        replies.append(reply)
        new_states.append(state)
    server_state, info = algorithm.server_step(
        server_state, _stack(replies), server_key, jnp.asarray(participating)
    )
    return server_state, _stack(new_states), info
