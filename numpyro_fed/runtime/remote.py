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
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.protocol import FederatedAlgorithm, SiloData, jit_algorithm
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
      ``jax.ShapeDtypeStruct`` leaves (the layout every silo pads its data to).
    - **round_keys** - ``rng_key -> (rng_key, server_key)``: the server's key chain.
    - **silo_key_like** - the ``jax.ShapeDtypeStruct`` of one silo's round key.
    """

    algorithm: FederatedAlgorithm
    num_silos: int
    silo_spec: SiloData
    round_keys: Callable
    silo_key_like: Any


def silo_key(root: jax.Array, round_index: int, like: Any) -> jax.Array:
    """Silo key for ``round_index`` (``-1``: the silo's initial state), shaped like
    ``like``, from the silo's own ``root`` key."""
    key = jax.random.fold_in(root, round_index + 1)
    return jax.random.split(key, like.shape) if like.shape else key


def _templates(fed: Federation) -> dict:
    alg = fed.algorithm
    key = jax.random.key(0)
    _, server_key = jax.eval_shape(fed.round_keys, key)
    server = jax.eval_shape(alg.init_server, key)
    message = jax.eval_shape(alg.server_message, server, server_key)
    message_j = jax.eval_shape(lambda m: m.at(0), message)
    silo = jax.eval_shape(alg.init_silo, key, fed.silo_spec)
    reply = jax.eval_shape(
        alg.silo_step, message_j, silo, fed.silo_spec, fed.silo_key_like
    )[0]
    return dict(server=server, message=message_j, silo=silo, reply=reply)


class RemoteServer:
    """
    The server half of a remote round.

    :param Federation federation: what every process agrees on.
    """

    def __init__(self, federation: Federation) -> None:
        self.federation = federation
        self.algorithm = jit_algorithm(federation.algorithm)
        self.templates = _templates(federation)
        self._placeholder = zeros_like_shapes(self.templates["reply"])
        self._round_keys = jax.jit(federation.round_keys)

    def init(self, rng_key: jax.Array) -> tuple[Any, jax.Array]:
        """``(server_state, rng_key)`` to start from."""
        rng_key, init_key = jax.random.split(rng_key)
        return self.algorithm.init_server(init_key), rng_key

    def messages(
        self, state: Any, rng_key: jax.Array, available: np.ndarray
    ) -> tuple[dict[int, dict], Any]:
        """This round's flat message for every silo the server contacts.

        :param state: the server state.
        :param rng_key: the run's key before this round.
        :param available: ``(J,)`` booleans, the silos the transport can reach.
        :return: ``({silo: flat message}, round)``; pass ``round`` to :meth:`apply`.
        """
        num_silos = self.federation.num_silos
        rng_key, server_key = self._round_keys(rng_key)
        chosen = np.asarray(self.algorithm.select(state, server_key, num_silos))
        contacted = np.flatnonzero(chosen & np.asarray(available, bool))
        message = self.algorithm.server_message(state, server_key)
        broadcast = encode(message.broadcast)
        out = {}
        for j in contacted:
            routed = encode(jax.tree.map(lambda x, j=j: x[j], message.routed))
            out[int(j)] = {
                **{"broadcast" + k: v for k, v in broadcast.items()},
                **{"routed" + k: v for k, v in routed.items()},
            }
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
        num_silos = self.federation.num_silos
        decoded = {
            j: decode(flat, self.templates["reply"], source=f"silo {j}'s reply")
            for j, flat in sorted(replies.items())
        }
        rows = [decoded.get(j, self._placeholder) for j in range(num_silos)]
        participating = np.zeros(num_silos, bool)
        participating[list(decoded)] = True
        state, info = self.algorithm.server_step(
            state, stack(rows), server_key, jnp.asarray(participating)
        )
        return state, rng_key, info


class RemoteSilo:
    """
    The silo half of a remote round: one silo's data, state and key.

    :param Federation federation: what every process agrees on.
    :param SiloData data: this silo's data, padded to ``federation.silo_spec``.
    :param jax.Array root_key: this silo's own key; it never leaves the silo.
    """

    def __init__(
        self, federation: Federation, data: SiloData, root_key: jax.Array
    ) -> None:
        self.federation = federation
        self.templates = _templates(federation)
        spec = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), data)
        if spec != federation.silo_spec:
            expected = sorted(federation.silo_spec.nested)
            ragged = (
                f" The model's nested plates {expected} are ragged: give each one's "
                "real size on this silo in SiloData(..., nested={plate: size})."
                if sorted(data.nested) != expected
                else ""
            )
            raise ValueError(
                f"This silo's data {spec} do not have the federation's layout "
                f"{federation.silo_spec}: pad them to the same units and dtypes."
                + ragged
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
        the flat state (``None``: start from :meth:`init`)."""
        message = _unprefix(message, self.templates["message"])
        state = decode(
            self.init() if state is None else state,
            self.templates["silo"],
            source="the stored silo state",
        )
        key = silo_key(self.root_key, round_index, self.federation.silo_key_like)
        reply, state = self._step(message, state, self.data, key)
        return encode(reply), encode(state)


def _unprefix(flat: dict, template: Any) -> Any:
    parts = {"broadcast": {}, "routed": {}}
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

    :return: ``(server_state, infos)``.
    """
    server = RemoteServer(federation)
    silos = [
        RemoteSilo(federation, d, k)
        for d, k in zip(silo_data, silo_roots, strict=True)
    ]
    states: list = [None] * len(silos)
    state, rng_key = server.init(rng_key)
    infos = []
    for t in range(num_rounds):
        reach = (
            np.ones(federation.num_silos, bool) if available is None else available(t)
        )
        messages, round_ = server.messages(state, rng_key, reach)
        replies = {}
        for j, message in messages.items():
            replies[j], states[j] = silos[j].step(message, states[j], t)
        state, rng_key, info = server.apply(state, round_, replies)
        infos.append(info)
    return state, infos
