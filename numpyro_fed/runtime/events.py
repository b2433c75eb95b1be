# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Event-driven runtime: silos visited one at a time in a given order, each reading
a server message that may be a few updates old, the server updating after every
reply. With no staleness this is the sequential schedule (PVI's "sequential",
Gauss-Seidel-style SFVI); with staleness it is the asynchronous one. It works for
any :class:`~numpyro_fed.FederatedAlgorithm`."""

from typing import Any, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from numpyro_fed.protocol import FederatedAlgorithm, SiloData, select_all
from numpyro_fed.util import take, tree_where, zeros_like_shapes

__all__ = ["EventSchedule", "event_round", "event_schedule"]


class EventSchedule(NamedTuple):
    """One pass of events.

    - **order** - ``(E,)`` ints: the silo visited at each event.
    - **staleness** - ``(E,)`` ints: how many server updates old the message that
      silo reads is (0: the current one).
    - **server_keys** - ``(E, ...)``: the server key of each event.
    """

    order: jax.Array
    staleness: jax.Array
    server_keys: jax.Array


def event_schedule(
    key: jax.Array,
    num_silos: int,
    *,
    order: str = "cyclic",
    max_staleness: int = 0,
    server_keys: jax.Array | None = None,
) -> EventSchedule:
    """A pass that visits every silo once: in index order (``"cyclic"``) or a random
    permutation (``"random"``), each reading a message up to ``max_staleness``
    updates old, drawn uniformly; the events' server keys are ``server_keys`` or
    drawn from ``key``."""
    order_key, lag_key, server_key = jax.random.split(key, 3)
    visits = jnp.arange(num_silos)
    if order == "random":
        visits = jax.random.permutation(order_key, num_silos)
    lags = jax.random.randint(lag_key, (num_silos,), 0, max_staleness + 1)
    if server_keys is None:
        server_keys = jax.random.split(server_key, num_silos)
    return EventSchedule(visits, lags, server_keys)


def event_round(
    algorithm: FederatedAlgorithm,
    server_state: Any,
    silo_states: Any,
    silo_data: SiloData,
    schedule: EventSchedule,
    silo_keys: jax.Array,
    participating: jax.Array | None = None,
    *,
    max_staleness: int = 0,
) -> tuple[Any, Any, Any]:
    """
    One pass of events, inside one ``lax.scan`` (pure and jit-able).

    At event ``i`` the server forms its message from its current state, silo
    ``order[i]`` steps on the message of ``staleness[i]`` server updates ago (never
    older than the pass's start, nor than ``max_staleness``), and the server steps
    on that one reply. A silo not chosen by ``select`` (or not ``participating``)
    is skipped: its state and the server's are left as they were.

    :param EventSchedule schedule: the visits, their staleness and server keys.
    :param silo_keys: one key per silo (leading silo axis).
    :param participating: optional ``(J,)`` booleans (default: all).
    :param int max_staleness: the length of the message buffer, less one (static).
    :return: ``(server_state, silo_states, infos)`` with the server's infos stacked
        along a leading event axis.
    """
    num_silos = silo_data.mask.shape[0]
    if participating is None:
        participating = jnp.ones((num_silos,), bool)
    first_key = take(schedule.server_keys, 0)
    first = algorithm.server_message(server_state, first_key)
    buffer = jax.tree.map(
        lambda x: jnp.broadcast_to(x, (max_staleness + 1,) + x.shape), first
    )
    reply_shapes = jax.eval_shape(
        algorithm.silo_step,
        first.at(0),
        take(silo_states, 0),
        take(silo_data, 0),
        silo_keys[0],
    )[0]
    no_replies = jax.tree.map(
        lambda x: jnp.zeros((num_silos,) + x.shape, x.dtype),
        zeros_like_shapes(reply_shapes),
    )

    def event(carry, inputs):
        server, silos, buffer = carry
        j, lag, key = inputs
        chosen = participating[j]
        if algorithm.select is not select_all:
            chosen = chosen & algorithm.select(server, key, num_silos)[j]
        now = algorithm.server_message(server, key)
        buffer = jax.tree.map(
            lambda buf, x: jnp.concatenate([x[None], buf[:-1]]), buffer, now
        )
        read = take(buffer, jnp.minimum(lag, max_staleness))
        old = take(silos, j)
        reply, new = algorithm.silo_step(
            read.at(j), old, take(silo_data, j), silo_keys[j]
        )
        replies = jax.tree.map(lambda z, r: z.at[j].set(r), no_replies, reply)
        contacted = jnp.zeros((num_silos,), bool).at[j].set(chosen)
        new_server, info = algorithm.server_step(server, replies, key, contacted)
        server = tree_where(chosen, new_server, server)
        new = tree_where(chosen, new, old)
        silos = jax.tree.map(lambda x, y: x.at[j].set(y), silos, new)
        return (server, silos, buffer), info

    (server_state, silo_states, _), infos = lax.scan(
        event,
        (server_state, silo_states, buffer),
        (schedule.order, schedule.staleness, schedule.server_keys),
    )
    return server_state, silo_states, infos
