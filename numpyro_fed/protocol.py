# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The algorithm contract: a NamedTuple of pure functions over pytrees.

Like optax's ``GradientTransformation``, a federated algorithm is data, not a class
hierarchy, so the same functions run under every runtime (vmapped simulation,
one silo at a time, event-driven, Flower). A round is::

    contacted = select(server_state, key, num_silos)                  # whom to ask
    message = server_message(server_state, key)                       # server -> silos
    reply_j, silo_state_j = silo_step(message.at(j), silo_state_j, silo_data_j, key_j)
    server_state, info = server_step(server_state, replies, key, contacted)

An algorithm whose server reads only the sum of the contacted silos' replies (SFVI's
gradients) may also offer ``reduce_silos``: every silo stepped at once with the
replies already summed (:class:`SummedReplies`), which a simulation can compute in one
pull-back through the shared global quantities instead of one per silo. Runtimes that
carry replies one by one (sequential, events, Flower) never call it.

``message.at(j)`` is silo j's view of the message: the broadcast part and row j of
the routed part. Every state, message and reply is a pytree of arrays whose treedef
does not change from round to round (no ``None`` toggles, no Python scalars), so one
codec can ship it and one compiled round serves every round.

The key handed to ``silo_step`` belongs to the silo: a runtime draws it on the silo
(or, in simulation, splits it from the run's key apart from the server's); nothing in
a server message lets the server replay a silo's computation (except in the
``reproducible=True`` test modes of FSGLD, DSGLD and SFVI, which say so).
"""

from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

__all__ = [
    "FederatedAlgorithm",
    "InitServerFn",
    "InitSiloFn",
    "Message",
    "MessageFn",
    "ReduceSilosFn",
    "SelectFn",
    "ServerStepFn",
    "SiloData",
    "SiloStepFn",
    "SummedReplies",
    "jit_algorithm",
    "reply_sum",
    "select_all",
    "silo_data_of",
    "vmap_silos",
]


class SiloData(NamedTuple):
    """One silo's data, or all silos' stacked along a leading silo axis.

    - **arrays** - dict of arrays in the model's layout (units along axis 0), padded
      (vertical FL: party -> the dict of arrays that party holds).
    - **mask** - booleans, True for the silo's real units.
    - **unit_ids** - each unit's index in the pooled data (-1 for padding).
    - **nested** - dict plate name -> the silo's real size of each plate nested in the
      silo plate whose size differs across silos (ragged nested axes; empty when
      none): entries beyond it are padding, masked out of every site.
    """

    arrays: dict[str, Any]
    mask: jax.Array
    unit_ids: jax.Array
    nested: dict[str, jax.Array] = {}


def silo_data_of(data: Any, nested: dict | None = None) -> SiloData:
    """The stacked :class:`SiloData` of a :class:`~numpyro_fed.FederatedData`.

    :param dict nested: ``(J,)`` real sizes of the ragged nested plates
        (:func:`~numpyro_fed.partition.nested_sizes`), if any.
    """
    nested = {k: jnp.asarray(v, jnp.int32) for k, v in (nested or {}).items()}
    return SiloData(dict(data.arrays), data.mask, data.unit_ids, nested)


class Message(NamedTuple):
    """What the server sends in a round.

    - **broadcast** - the part every contacted silo receives.
    - **routed** - the part addressed to each silo separately, stacked along a leading
      silo axis (PVI's acknowledgements, vertical FL's per-party gradients); ``()``
      when the algorithm routes nothing. Silo j receives only row j.
    """

    broadcast: Any
    routed: Any = ()

    def at(self, silo: Any) -> "Message":
        """Silo ``silo``'s view: the broadcast and row ``silo`` of the routed part."""
        return Message(self.broadcast, jax.tree.map(lambda x: x[silo], self.routed))


class InitServerFn(Protocol):
    def __call__(self, key: jax.Array, /) -> Any:
        """The server's initial state.

        :param key: the server's key.
        :return: the server state ``S``.
        """


class InitSiloFn(Protocol):
    def __call__(self, key: jax.Array, data: SiloData, /) -> Any:
        """One silo's initial state, from its own data.

        :param key: the silo's key.
        :param data: the silo's :class:`SiloData` (no silo axis).
        :return: the silo state ``L``.
        """


class MessageFn(Protocol):
    def __call__(self, state: Any, key: jax.Array, /) -> Message:
        """What the server sends this round.

        :param state: the server state.
        :param key: the round's server key.
        :return: a :class:`Message`.
        """


class SiloStepFn(Protocol):
    def __call__(
        self, message: Message, state: Any, data: SiloData, key: jax.Array, /
    ) -> tuple[Any, Any]:
        """The whole silo side of a round.

        :param message: the silo's view of the message (``Message.at(j)``).
        :param state: the silo's state.
        :param data: the silo's own data.
        :param key: the silo's own key.
        :return: ``(reply, state)``: what goes back to the server, and what stays.
        """


class ServerStepFn(Protocol):
    def __call__(
        self, state: Any, replies: Any, key: jax.Array, participating: jax.Array, /
    ) -> tuple[Any, Any]:
        """The server's update from the silos' replies.

        :param state: the server state.
        :param replies: every silo's reply, stacked along a leading silo axis;
            rows of silos that were not contacted hold placeholders. An algorithm
            with ``reduce_silos`` also takes :class:`SummedReplies` here, and reads
            both through :func:`reply_sum`.
        :param key: the round's server key (the one ``server_message`` got).
        :param participating: ``(J,)`` booleans, the silos whose reply arrived.
        :return: ``(state, info)``; ``info`` is a NamedTuple with at least ``loss``
            (a scalar) and ``rejected`` (``(J,)`` booleans: replies that arrived and
            were dropped because they were not finite or not valid).
        """


class SummedReplies(NamedTuple):
    """The silos' replies as a sum-reduced server reads them.

    - **total** - :math:`\\sum_j` of the replies of the silos in ``used`` (the
      reply's pytree, no silo axis).
    - **used** - ``(J,)`` booleans: the silos whose replies are in ``total``.
    """

    total: Any
    used: jax.Array


class ReduceSilosFn(Protocol):
    def __call__(
        self,
        message: "Message",
        states: Any,
        data: "SiloData",
        keys: jax.Array,
        contacted: jax.Array,
        /,
    ) -> tuple[SummedReplies, Any]:
        """Every silo's ``silo_step`` at once, the replies summed over ``contacted``.

        :param message: the whole message (routed part with a leading silo axis).
        :param states: the silos' states, stacked along a leading silo axis.
        :param data: the silos' data, stacked.
        :param keys: one key per silo.
        :param contacted: ``(J,)`` booleans.
        :return: ``(SummedReplies(total, used), states)``: the same sum and states
            as :func:`jax.vmap` of ``silo_step`` would give (to rounding), with the
            non-finite guard's silo rule applied inside
            (:func:`~numpyro_fed.guard.guarded_sum`): a silo whose reply or new
            state is not finite is left out of ``used`` and keeps its state.
        """


def reply_sum(replies: Any, used: jax.Array) -> Any:
    """:math:`\\sum_j` of the ``used`` rows of stacked replies, or the total of
    :class:`SummedReplies` (already restricted to its ``used``): how a sum-reduced
    ``server_step`` reads its replies under any runtime."""
    if isinstance(replies, SummedReplies):
        return replies.total

    def masked_sum(x):
        rows = used.reshape((-1,) + (1,) * (x.ndim - 1))
        return jnp.sum(jnp.where(rows, x, 0), axis=0)

    return jax.tree.map(masked_sum, replies)


class SelectFn(Protocol):
    def __call__(self, state: Any, key: jax.Array, num_silos: int, /) -> jax.Array:
        """Whom the server contacts this round.

        :param state: the server state.
        :param key: the round's server key.
        :param num_silos: ``J``.
        :return: ``(J,)`` booleans.
        """


def select_all(state: Any, key: jax.Array, num_silos: int) -> jax.Array:
    """The default :class:`SelectFn`: every silo, every round."""
    del state, key
    return jnp.ones((num_silos,), bool)


class FederatedAlgorithm(NamedTuple):
    """A federated algorithm as pure functions (no ``self``, no I/O), each typed by
    a ``Protocol`` above.

    - **init_server** - :class:`InitServerFn`.
    - **init_silo** - :class:`InitSiloFn`.
    - **server_message** - :class:`MessageFn`.
    - **silo_step** - :class:`SiloStepFn`.
    - **server_step** - :class:`ServerStepFn`.
    - **select** - :class:`SelectFn` (default :func:`select_all`).
    - **reduce_silos** - :class:`ReduceSilosFn`, or ``None`` (the runtimes step the
      silos one by one, or vmapped, and stack the replies).
    """

    init_server: InitServerFn
    init_silo: InitSiloFn
    server_message: MessageFn
    silo_step: SiloStepFn
    server_step: ServerStepFn
    select: SelectFn = select_all
    reduce_silos: ReduceSilosFn | None = None


def jit_algorithm(algorithm: FederatedAlgorithm) -> FederatedAlgorithm:
    """The same algorithm with each function jitted on its own (for runtimes that
    call them one at a time, and so have no use for ``reduce_silos``); ``select``'s
    ``num_silos`` is static."""
    select = algorithm.select
    if select is not select_all:
        select = jax.jit(select, static_argnums=2)
    return FederatedAlgorithm(
        jax.jit(algorithm.init_server),
        jax.jit(algorithm.init_silo),
        jax.jit(algorithm.server_message),
        jax.jit(algorithm.silo_step),
        jax.jit(algorithm.server_step),
        select,
    )


def vmap_silos(
    silo_step: Any, message: Message, states: Any, data: SiloData, keys: jax.Array
) -> tuple[Any, Any]:
    """Every silo's ``silo_step`` at once under :func:`jax.vmap` (the routed part of
    ``message`` and the silos' states, data and keys along a leading silo axis)."""
    return jax.vmap(silo_step, in_axes=(Message(None, 0), 0, 0, 0))(
        message, states, data, keys
    )
