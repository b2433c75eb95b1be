# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Sequential runtime: one silo at a time, as a real deployment would run them.

Each silo sees only its own slice of the data and state and its own row of the
routed message; the server sees only the replies. This is the template for
distributed runtimes and the reference that the vmapped simulation is tested against.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.protocol import FederatedAlgorithm, SiloData
from numpyro_fed.runtime.simulate import contacted_silos
from numpyro_fed.util import stack, take, zeros_like_shapes

__all__ = ["sequential_round"]


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
    are not contacted are not run, and the server gets a placeholder in their row.

    Takes and returns the same stacked layout as
    :func:`~numpyro_fed.runtime.simulate_round`, so the two are interchangeable.
    Pass ``algorithm`` with jitted functions for speed.

    :return: ``(server_state, silo_states, info)``.
    """
    num_silos = silo_data.mask.shape[0]
    chosen = contacted_silos(
        algorithm, server_state, server_key, num_silos, participating
    )
    contacted = np.ones(num_silos, bool) if chosen is None else np.asarray(chosen)
    message = algorithm.server_message(server_state, server_key)
    replies, new_states, placeholder = [], [], None
    for j in range(num_silos):
        state, data = take(silo_states, j), take(silo_data, j)
        if contacted[j]:
            reply, state = algorithm.silo_step(message.at(j), state, data, silo_keys[j])
        else:
            if placeholder is None:
                shapes = jax.eval_shape(
                    algorithm.silo_step, message.at(j), state, data, silo_keys[j]
                )[0]
                placeholder = zeros_like_shapes(shapes)
            reply = placeholder
        replies.append(reply)
        new_states.append(state)
    server_state, info = algorithm.server_step(
        server_state, stack(replies), server_key, jnp.asarray(contacted)
    )
    return server_state, stack(new_states), info
