# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""What crosses the wire: bytes per silo and direction for any algorithm, read off
the shapes of its messages (nothing is run)."""

from typing import Any, NamedTuple

import jax
import numpy as np

from numpyro_fed.protocol import FederatedAlgorithm, SiloData
from numpyro_fed.util import take

__all__ = ["RoundBytes", "nbytes", "round_bytes"]


class RoundBytes(NamedTuple):
    """Bytes one contacted silo exchanges in one round.

    - **broadcast** - the broadcast part of the server's message.
    - **routed** - the silo's own row of the routed part.
    - **reply** - the silo's reply.
    """

    broadcast: int
    routed: int
    reply: int

    @property
    def down(self) -> int:
        """Server to silo: ``broadcast + routed``."""
        return self.broadcast + self.routed


def _leaf_bytes(x: Any) -> int:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
        # A typed key travels as its key data (two uint32 for threefry).
        x = jax.eval_shape(jax.random.key_data, x)
    return int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize


def nbytes(tree: Any) -> int:
    """Bytes of the array leaves of ``tree`` (arrays or ``ShapeDtypeStruct``; a typed
    PRNG key counts as its key data)."""
    return sum(_leaf_bytes(x) for x in jax.tree.leaves(tree))


def round_bytes(
    algorithm: FederatedAlgorithm,
    server_state: Any,
    silo_states: Any,
    silo_data: SiloData,
    server_key: jax.Array,
    silo_keys: jax.Array,
) -> RoundBytes:
    """The bytes of silo 0's messages in a round from these states (every silo's
    are the same size: states and data are padded to one shape)."""
    message = jax.eval_shape(algorithm.server_message, server_state, server_key)
    routed = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), message.routed
    )
    reply = jax.eval_shape(
        lambda m, s, d, k: algorithm.silo_step(m.at(0), take(s, 0), take(d, 0), k[0])[
            0
        ],
        message,
        silo_states,
        silo_data,
        silo_keys,
    )
    return RoundBytes(nbytes(message.broadcast), nbytes(routed), nbytes(reply))
