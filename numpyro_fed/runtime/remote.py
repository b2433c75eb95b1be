# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The two halves of a round when silos live in other processes, for any transport.

:class:`RemoteServer` turns the server state into one flat message per contacted silo
and applies the flat replies that came back; :class:`RemoteSilo` runs ``silo_step`` on
a silo's own data, state and key. Both speak :mod:`~numpyro_fed.runtime.codec` flat
dicts, so a transport (Flower, or the in-process loop of :func:`run_remote` that
tests use) only moves dicts of numpy arrays and knows no algorithm.

What stays on the silo: its data, its state and its randomness. A silo's key for
round ``t`` is folded from a root key that only the silo holds (:func:`silo_key`), so
nothing the server sends lets it replay a silo's computation. A reply that does not
match the reply template is refused with an error that names the silo and the field,
before anything is applied; a reply that never came is a silo that did not take part.

Silos whose data and states differ in structure (vertical FL's parties) give one data
layout per silo (``Federation.silo_spec`` a tuple): each silo's state and reply are
then read against its own template. An algorithm whose round is several contract
rounds on the same keys (``Federation.exchanges``) has the key chain advance once per
round, for the server and the silos alike.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.checks import check_count
from numpyro_fed.protocol import (
    FederatedAlgorithm,
    SiloData,
    jit_algorithm,
    select_all,
)
from numpyro_fed.runtime.codec import decode, encode
from numpyro_fed.util import stack, zeros_like_shapes

__all__ = [
    "Federation",
    "RemoteServer",
    "RemoteSilo",
    "run_remote",
    "silo_key",
]


class Federation(NamedTuple):
    """What every process of a federated run agrees on, besides the data.

    - **algorithm** - the :class:`~numpyro_fed.FederatedAlgorithm`.
    - **num_silos** - ``J``.
    - **silo_spec** - one silo's :class:`~numpyro_fed.protocol.SiloData` as
      ``jax.ShapeDtypeStruct`` leaves (the layout every silo pads its data to), or a
      tuple of one such layout per silo when the silos' data differ in structure.
    - **round_keys** - ``rng_key -> (rng_key, server_key)``: the server's key chain.
    - **silo_key_like** - the ``jax.ShapeDtypeStruct`` of one silo's round key.
    - **exchanges** - contract rounds (message, replies, server step) per round, all
      on the round's server key and silo keys (default 1): an algorithm whose
      iteration takes several phases on one draw of its noise.
    - **schedule** - ``rng_key -> (rng_key, EventSchedule)``: run each round as one
      pass of events (visit order, staleness and server keys, as
      :func:`~numpyro_fed.runtime.event_round` runs them: the sequential and
      asynchronous schedules), or ``None`` (default): synchronous rounds.
    """

    algorithm: FederatedAlgorithm
    num_silos: int
    silo_spec: Any
    round_keys: Callable
    silo_key_like: Any
    exchanges: int = 1
    schedule: Callable | None = None

    def spec(self, silo: int | None) -> SiloData:
        """Silo ``silo``'s data layout (``None``: the layout every silo shares)."""
        if isinstance(self.silo_spec, SiloData):
            return self.silo_spec
        if silo is None:
            raise ValueError(
                "The federation's silos have data of different structure: name the "
                "silo (RemoteSilo(..., silo=j))."
            )
        if len(self.silo_spec) != self.num_silos or not 0 <= silo < self.num_silos:
            raise ValueError(
                f"The federation gives {len(self.silo_spec)} silo layouts for "
                f"{self.num_silos} silos; silo {silo} has none."
            )
        return self.silo_spec[silo]


def silo_key(root: jax.Array, round_index: int, like: Any) -> jax.Array:
    """Silo key for ``round_index`` (``-1``: the silo's initial state), shaped like
    ``like``, from the silo's own ``root`` key."""
    key = jax.random.fold_in(root, round_index + 1)
    return jax.random.split(key, like.shape) if like.shape else key


def _templates(fed: Federation, silo: int | None) -> dict:
    alg = fed.algorithm
    key = jax.random.key(0)
    _, server_key = jax.eval_shape(fed.round_keys, key)
    server = jax.eval_shape(alg.init_server, key)
    message = jax.eval_shape(alg.server_message, server, server_key)
    message_j = jax.eval_shape(lambda m: m.at(silo or 0), message)
    spec = fed.spec(silo)
    state = jax.eval_shape(alg.init_silo, key, spec)
    reply = jax.eval_shape(alg.silo_step, message_j, state, spec, fed.silo_key_like)[0]
    return dict(server=server, message=message_j, silo=state, reply=reply)


def _per_silo(fed: Federation) -> bool:
    return not isinstance(fed.silo_spec, SiloData)


class RemoteServer:
    """
    The server half of a remote round.

    :param Federation federation: what every process agrees on.
    """

    def __init__(self, federation: Federation) -> None:
        self.federation = federation
        self.algorithm = jit_algorithm(federation.algorithm)
        self.templates = _templates(federation, 0 if _per_silo(federation) else None)
        self.exchanges = check_count("exchanges", federation.exchanges)
        #: Each silo's reply template (one shared when the silos share a layout).
        self.replies = [self.templates["reply"]] * federation.num_silos
        if _per_silo(federation):
            self.replies = [
                _templates(federation, j)["reply"] for j in range(federation.num_silos)
            ]
        self._placeholders = [zeros_like_shapes(r) for r in self.replies]
        self._round_keys = jax.jit(federation.round_keys)
        if federation.schedule is not None:
            self._schedule = jax.jit(federation.schedule)

    def init(self, rng_key: jax.Array) -> tuple[Any, jax.Array]:
        """``(server_state, rng_key)`` to start from."""
        rng_key, init_key = jax.random.split(rng_key)
        return self.algorithm.init_server(init_key), rng_key

    def messages(
        self, state: Any, rng_key: jax.Array, available: np.ndarray, index: int = 0
    ) -> tuple[dict[int, dict], Any]:
        """This contract round's flat message for every silo the server contacts.

        :param state: the server state.
        :param rng_key: the run's key before this contract round.
        :param available: ``(J,)`` booleans, the silos the transport can reach.
        :param int index: the contract round's index in the run (the key chain
            advances after the last of every ``federation.exchanges``).
        :return: ``({silo: flat message}, round)``; pass ``round`` to :meth:`apply`.
        """
        num_silos = self.federation.num_silos
        next_key, server_key = self._round_keys(rng_key)
        if (index + 1) % self.exchanges == 0:
            rng_key = next_key
        chosen = np.asarray(self.algorithm.select(state, server_key, num_silos))
        contacted = np.flatnonzero(chosen & np.asarray(available, bool))
        message = self.algorithm.server_message(state, server_key)
        out = {int(j): _flat_message(message, int(j)) for j in contacted}
        return out, (rng_key, server_key)

    def apply(
        self, state: Any, round_: Any, replies: dict[int, dict]
    ) -> tuple[Any, jax.Array, Any]:
        """Apply the flat replies that arrived.

        :param state: the server state the messages came from.
        :param round_: what :meth:`messages` returned with them.
        :param dict replies: ``{silo: flat reply}`` of the silos that answered.
        :return: ``(server_state, rng_key, info)``.
        :raises TemplateMismatch: a reply that does not match the template (nothing
            is applied).
        """
        rng_key, server_key = round_
        state, info = self._server_step(state, replies, server_key)
        return state, rng_key, info

    def _server_step(self, state: Any, replies: dict, server_key: jax.Array):
        num_silos = self.federation.num_silos
        decoded = {
            j: decode(flat, self.replies[j], source=f"silo {j}'s reply")
            for j, flat in sorted(replies.items())
        }
        rows = [decoded.get(j, self._placeholders[j]) for j in range(num_silos)]
        participating = np.zeros(num_silos, bool)
        participating[list(decoded)] = True
        return self.algorithm.server_step(
            state, stack(rows), server_key, jnp.asarray(participating)
        )

    def round(
        self,
        state: Any,
        rng_key: jax.Array,
        available: np.ndarray,
        exchange: Callable[[dict[int, dict]], dict[int, dict]],
        index: int = 0,
    ) -> tuple[Any, jax.Array, Any, np.ndarray]:
        """
        One round through a transport: a synchronous contract round, or with
        ``federation.schedule`` one pass of events.

        :param state: the server state.
        :param rng_key: the run's key before this round.
        :param available: ``(J,)`` booleans, the silos the transport can reach.
        :param exchange: ``{silo: flat message} -> {silo: flat reply}``: the
            transport (the replies that arrived).
        :param int index: the round's index in the run.
        :return: ``(server_state, rng_key, info, contacted)``: for a pass, ``info``
            stacked along a leading event axis; ``contacted``: ``(J,)`` booleans.
        :raises TemplateMismatch: a reply that does not match its template (nothing
            of that contract round is applied).
        """
        if self.federation.schedule is not None:
            return self._events(state, rng_key, available, exchange)
        flat, round_ = self.messages(state, rng_key, available, index)
        state, rng_key, info = self.apply(state, round_, exchange(flat))
        return state, rng_key, info, np.isin(np.arange(len(available)), list(flat))

    def _events(self, state, rng_key, available, exchange):
        """One pass of ``federation.schedule`` as
        :func:`~numpyro_fed.runtime.event_round` runs it: at event ``i`` the server
        forms its message, silo ``order[i]`` steps on the message of
        ``staleness[i]`` updates ago (never older than the pass's start) and the
        server steps on its one reply; a silo not chosen (``select``) or out of
        reach is skipped and the server state kept."""
        alg, num_silos = self.algorithm, self.federation.num_silos
        rng_key, schedule = self._schedule(rng_key)
        order, lags = np.asarray(schedule.order), np.asarray(schedule.staleness)
        keys = list(schedule.server_keys)
        # the messages of the last updates, newest first; at the start of the pass
        # every slot holds the pass's first message
        buffer = [alg.server_message(state, keys[0])] * (int(lags.max(initial=0)) + 1)
        infos, contacted = [], np.zeros(num_silos, bool)
        for j, lag, key in zip(order.tolist(), lags.tolist(), keys, strict=True):
            chosen = bool(available[j])
            if chosen and alg.select is not select_all:
                chosen = bool(alg.select(state, key, num_silos)[j])
            buffer = [alg.server_message(state, key)] + buffer[:-1]
            replies = exchange({j: _flat_message(buffer[lag], j)}) if chosen else {}
            contacted[j] |= chosen
            new, info = self._server_step(state, replies, key)
            state = new if j in replies else state
            infos.append(info)
        return state, rng_key, stack(infos), contacted


def _flat_message(message: Any, j: int) -> dict:
    """Silo ``j``'s view of ``message`` (``Message.at(j)``) as one flat dict."""
    routed = encode(jax.tree.map(lambda x: x[j], message.routed))
    return {
        **{"broadcast" + k: v for k, v in encode(message.broadcast).items()},
        **{"routed" + k: v for k, v in routed.items()},
    }


class RemoteSilo:
    """
    The silo half of a remote round: one silo's data, state and key.

    :param Federation federation: what every process agrees on.
    :param SiloData data: this silo's data, padded to ``federation.spec(silo)``.
    :param jax.Array root_key: this silo's own key; it never leaves the silo.
    :param int silo: this silo's index (needed when the silos' layouts differ).
    """

    def __init__(
        self,
        federation: Federation,
        data: SiloData,
        root_key: jax.Array,
        silo: int | None = None,
    ) -> None:
        self.federation = federation
        silo = silo if _per_silo(federation) else None
        self.templates = _templates(federation, silo)
        self.exchanges = check_count("exchanges", federation.exchanges)
        expected_spec = federation.spec(silo)
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), data)
        if spec != expected_spec:
            expected = sorted(expected_spec.nested)
            ragged = (
                f" The model's nested plates {expected} are ragged: give each one's "
                "real size on this silo in SiloData(..., nested={plate: size})."
                if sorted(data.nested) != expected
                else ""
            )
            raise ValueError(
                f"This silo's data {spec} do not have the federation's layout "
                f"{expected_spec}: pad them to the same units and dtypes." + ragged
            )
        self.data = data
        self.root_key = root_key
        self._init = jax.jit(federation.algorithm.init_silo)
        self._step = jax.jit(federation.algorithm.silo_step)

    def init(self) -> dict:
        """The silo's initial state, flat."""
        key = silo_key(self.root_key, -1, jax.ShapeDtypeStruct((), self.root_key.dtype))
        return encode(self._init(key, self.data))

    def step(
        self, message: dict, state: dict | None, round_index: int
    ) -> tuple[dict, dict]:
        """One ``silo_step``: ``(flat reply, flat state)`` from a flat message and
        the flat state (``None``: start from :meth:`init`) in contract round
        ``round_index`` (whose key is its round's: ``round_index // exchanges``)."""
        message = _unprefix(message, self.templates["message"])
        state = decode(
            self.init() if state is None else state,
            self.templates["silo"],
            source="the stored silo state",
        )
        key = silo_key(
            self.root_key, round_index // self.exchanges, self.federation.silo_key_like
        )
        reply, state = self._step(message, state, self.data, key)
        return encode(reply), encode(state)


def _unprefix(flat: dict, template: Any) -> Any:
    parts: dict[str, dict] = {"broadcast": {}, "routed": {}}
    for name, value in flat.items():
        part = "broadcast" if name.startswith("broadcast") else "routed"
        parts[part][name[len(part) :]] = value
    return type(template)(
        decode(parts["broadcast"], template.broadcast, source="the server message"),
        decode(parts["routed"], template.routed, source="the server message"),
    )


def run_remote(
    federation: Federation,
    silo_data: list[SiloData],
    silo_roots: list[jax.Array],
    rng_key: jax.Array,
    num_rounds: int,
    *,
    available: Callable[[int], np.ndarray] | None = None,
) -> tuple[Any, list]:
    """
    The remote round run in one process, silo by silo, through flat dicts: what a
    transport does, without the transport (the reference Flower is tested against).
    ``num_rounds`` counts contract rounds (``federation.exchanges`` per round), or
    passes of events with ``federation.schedule``.

    :return: ``(server_state, infos)``.
    """
    server = RemoteServer(federation)
    silos = [
        RemoteSilo(federation, d, k, silo=j)
        for j, (d, k) in enumerate(zip(silo_data, silo_roots, strict=True))
    ]
    states: list = [None] * len(silos)
    state, rng_key = server.init(rng_key)
    infos = []
    for t in range(num_rounds):
        reach = (
            np.ones(federation.num_silos, bool) if available is None else available(t)
        )

        def exchange(messages, t=t):
            replies = {}
            for j, message in messages.items():
                replies[j], states[j] = silos[j].step(message, states[j], t)
            return replies

        state, rng_key, info, _ = server.round(state, rng_key, reach, exchange, t)
        infos.append(info)
    return state, infos
