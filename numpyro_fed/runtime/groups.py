# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Grouped runtime: silos whose states and data differ in structure, given as
*groups* of equal structure. Each group's states, data and keys are stacked along a
leading axis and stepped under :func:`jax.vmap` (a group of one is called as it is:
one group per silo is the plain loop); the routed part of the server's message is
split by group, and the replies, which must share one structure, are stacked back in
silo order for the server. It works for any
:class:`~numpyro_fed.FederatedAlgorithm`."""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.protocol import FederatedAlgorithm, Message
from numpyro_fed.runtime.simulate import contacted_silos
from numpyro_fed.util import rows_where, stack, take

__all__ = [
    "group_round",
    "stack_groups",
    "step_group",
    "step_groups",
    "unstack_groups",
]


def stack_groups(trees: list, groups: tuple) -> tuple:
    """One stacked tree per group of ``groups`` (tuples of silo indices) from the
    per-silo ``trees``."""
    return tuple(stack([trees[j] for j in group]) for group in groups)


def unstack_groups(stacked: tuple, groups: tuple) -> list:
    """The per-silo trees of :func:`stack_groups`'s output, in silo order."""
    out: dict = {}
    for tree, group in zip(stacked, groups, strict=True):
        for i, j in enumerate(group):
            out[j] = take(tree, i)
    return [out[j] for j in range(len(out))]


def step_group(
    silo_step: Any, broadcast: Any, routed: Any, states: Any, data: Any, keys: Any
) -> tuple[Any, Any]:
    """One group's ``(replies, new states)``, stacked: a group of one is called as
    it is, a larger one under :func:`jax.vmap` (``routed``: the group's rows)."""
    if keys.shape[0] == 1:
        reply, new = silo_step(
            Message(broadcast, take(routed, 0)), take(states, 0), take(data, 0), keys[0]
        )
        return stack([reply]), stack([new])
    return jax.vmap(silo_step, in_axes=(Message(None, 0), 0, 0, 0))(
        Message(broadcast, routed), states, data, keys
    )


def step_groups(
    silo_step: Any,
    broadcast: Any,
    routed: tuple,
    states: tuple,
    data: tuple,
    keys: tuple,
) -> tuple[list, list]:
    """Every group's :func:`step_group`, one after another: ``(replies, states)``,
    one stacked tree per group."""
    out = [
        step_group(silo_step, broadcast, *args)
        for args in zip(routed, states, data, keys, strict=True)
    ]
    return [r for r, _ in out], [s for _, s in out]


def group_round(
    algorithm: FederatedAlgorithm,
    groups: tuple,
    server_state: Any,
    silo_states: tuple,
    silo_data: tuple,
    server_key: jax.Array,
    silo_keys: tuple,
    participating: jax.Array | None = None,
    *,
    step_silos: Any = step_groups,
) -> tuple[Any, tuple, Any]:
    """
    One round over silos in groups of equal structure.

    Pure and jit-able; with the algorithm's functions jitted one by one
    (:func:`~numpyro_fed.protocol.jit_algorithm`) and one group per silo it is also
    the sequential runtime, run eagerly.

    :param FederatedAlgorithm algorithm: the algorithm.
    :param tuple groups: static: one tuple of silo indices per group, together
        ``0 .. J-1`` once each.
    :param server_state: the server's state.
    :param tuple silo_states: per group, its silos' states stacked.
    :param tuple silo_data: per group, its silos' data stacked.
    :param jax.Array server_key: the round's server key.
    :param tuple silo_keys: per group, its silos' keys stacked.
    :param jax.Array participating: optional ``(J,)`` booleans (default: all).
    :param step_silos: how the groups are stepped, as :func:`step_groups` (the
        sharded runtime spreads them over devices).
    :return: ``(server_state, silo_states, info)``, the states grouped as given.
    """
    num_silos = sum(len(g) for g in groups)
    contacted = contacted_silos(
        algorithm, server_state, server_key, num_silos, participating
    )
    message = algorithm.server_message(server_state, server_key)
    rows = [np.asarray(g) for g in groups]
    routed = tuple(jax.tree.map(lambda x, r=r: x[r], message.routed) for r in rows)
    replies, states = step_silos(
        algorithm.silo_step,
        message.broadcast,
        routed,
        tuple(silo_states),
        tuple(silo_data),
        tuple(silo_keys),
    )
    if contacted is not None:
        states = [
            rows_where(contacted[r], new, old)
            for r, new, old in zip(rows, states, silo_states, strict=True)
        ]
    order = np.argsort(np.concatenate(rows))
    replies = jax.tree.map(lambda *xs: jnp.concatenate(xs)[order], *replies)
    if contacted is None:
        contacted = jnp.ones((num_silos,), bool)
    server_state, info = algorithm.server_step(
        server_state, replies, server_key, contacted
    )
    return server_state, tuple(states), info
