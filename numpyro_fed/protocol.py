# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The algorithm contract: a NamedTuple of pure functions over pytrees.

Like optax's ``GradientTransformation``, a federated algorithm is data, not a class
hierarchy, so the same functions run under every runtime (vmapped simulation,
one-silo-at-a-time, Flower). A round is::

    message = server_message(server_state, server_key)          # server -> silos
    reply_j, silo_state_j = silo_step(message, silo_state_j, silo_data_j, silo_key_j)
    server_state, info = server_step(server_state, replies, server_key, participating)

``server_message`` is split out of ``server_step`` (DESIGN.md bundles them) so that a
round's broadcast is drawn from that round's key: a runtime can then replay any round,
and the simulation matches centralized NumPyro SVI draw for draw.
"""

from typing import Any, Callable, NamedTuple

import jax

__all__ = ["FederatedAlgorithm", "SiloData", "silo_data_of"]


class SiloData(NamedTuple):
    """One silo's data, or all silos' stacked along a leading silo axis.

    - **arrays** - dict of arrays in the model's layout (units along axis 0), padded.
    - **mask** - booleans, True for the silo's real units.
    - **unit_ids** - each unit's index in the pooled data (-1 for padding).
    """

    arrays: dict[str, jax.Array]
    mask: jax.Array
    unit_ids: jax.Array


def silo_data_of(data: Any) -> SiloData:
    """The stacked :class:`SiloData` of a :class:`~numpyro_fed.FederatedData`."""
    return SiloData(dict(data.arrays), data.mask, data.unit_ids)


class FederatedAlgorithm(NamedTuple):
    """A federated algorithm as pure functions (no ``self``, no I/O).

    - **init_server** - ``(key) -> server_state``.
    - **init_silo** - ``(key, silo_data) -> silo_state``.
    - **server_message** - ``(server_state, key) -> server_message``: what the server
      broadcasts this round.
    - **silo_step** - ``(server_message, silo_state, silo_data, key) ->
      (silo_message, silo_state)``: the whole silo side of a round.
    - **server_step** - ``(server_state, silo_messages, key, participating) ->
      (server_state, info)``: ``silo_messages`` are stacked along a leading silo
      axis and ``participating`` (``(J,)`` booleans, or ``None`` for all) says which
      of them were sent this round. Partial participation is the runtime's choice;
      how to aggregate a subset is the algorithm's.
    """

    init_server: Callable[..., Any]
    init_silo: Callable[..., Any]
    server_message: Callable[..., Any]
    silo_step: Callable[..., tuple[Any, Any]]
    server_step: Callable[..., tuple[Any, Any]]
