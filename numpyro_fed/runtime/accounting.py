# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""What crosses the wire: bytes per silo and direction for any algorithm, read off
the shapes of its messages (nothing is run)."""

from typing import Any, NamedTuple

import jax
import numpy as np

from numpyro_fed.protocol import FederatedAlgorithm, Message, SiloData
from numpyro_fed.util import take

__all__ = ["RoundBytes", "bytes_history", "nbytes", "round_bytes", "silo_bytes"]


class RoundBytes(NamedTuple):
    """Bytes one contacted silo exchanges in one round (from :func:`silo_bytes`:
    one entry per silo).

    - **broadcast** - the broadcast part of the server's message.
    - **routed** - the silo's own row of the routed part.
    - **reply** - the silo's reply.

    Each is an ``int`` (:func:`round_bytes`) or ``(J,)`` integers (:func:`silo_bytes`).
    """

    broadcast: int | np.ndarray
    routed: int | np.ndarray
    reply: int | np.ndarray

    @property
    def down(self) -> int | np.ndarray:
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


def silo_bytes(
    algorithm: FederatedAlgorithm,
    server_state: Any,
    silo_states: Any,
    silo_data: Any,
    server_key: jax.Array,
    silo_keys: jax.Array,
    groups: tuple | None = None,
) -> RoundBytes:
    """
    The bytes each silo exchanges when it is contacted in a round from these states,
    as ``(J,)`` integer arrays (read off the messages' shapes; nothing runs).

    :param groups: ``None`` for silos stacked along a leading axis; otherwise the
        grouped runtime's groups (:func:`~numpyro_fed.runtime.group_round`), with
        ``silo_states`` and ``silo_data`` one stacked tree per group.
    :rtype: RoundBytes
    """
    num_silos = silo_keys.shape[0]
    if groups is None:
        groups = (tuple(range(num_silos)),)
        silo_states, silo_data = (silo_states,), (silo_data,)
    message = jax.eval_shape(algorithm.server_message, server_state, server_key)
    row = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), message.routed
    )
    key = jax.ShapeDtypeStruct(silo_keys.shape[1:], silo_keys.dtype)
    reply = np.zeros(num_silos, np.int64)
    for group, states, data in zip(groups, silo_states, silo_data, strict=True):
        shape = jax.eval_shape(
            lambda m, s, d, k: algorithm.silo_step(m, take(s, 0), take(d, 0), k)[0],
            Message(message.broadcast, row),
            states,
            data,
            key,
        )
        reply[np.asarray(group)] = nbytes(shape)
    full = lambda n: np.full(num_silos, n, np.int64)  # noqa: E731
    return RoundBytes(full(nbytes(message.broadcast)), full(nbytes(row)), reply)


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
    sizes = silo_bytes(
        algorithm, server_state, silo_states, silo_data, server_key, silo_keys
    )
    broadcast, routed, reply = (int(np.asarray(x)[0]) for x in sizes)
    return RoundBytes(broadcast, routed, reply)


def bytes_history(contacted: Any, sizes: RoundBytes, exchanges: int = 1) -> dict:
    """
    Bytes on the wire in every round: ``{"bytes_down": (T,), "bytes_up": (T,)}``,
    summed over the silos each round contacted.

    :param contacted: ``(T, J)`` booleans, the silos each round contacted.
    :param RoundBytes sizes: per silo (:func:`silo_bytes`).
    :param int exchanges: contract rounds per round (all sent in full).
    """
    counts = np.asarray(contacted, np.int64)
    return {
        "bytes_down": exchanges * counts @ (sizes.broadcast + sizes.routed),
        "bytes_up": exchanges * counts @ sizes.reply,
    }
