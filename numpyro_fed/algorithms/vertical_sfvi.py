# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Vertical federated VI (Hassan et al. seed 003, Algorithms 1 and 2) as a
:class:`~numpyro_fed.FederatedAlgorithm`: the parties are the silos, the
label-holding server is the server.

Algorithm 1 (``kind="augmented"``) takes two contract rounds (*phases*) per
iteration, run in order with the same keys:

0. **send**: party :math:`j` draws :math:`(\\theta_j, z_j)` with noise from its own key
   and replies :math:`z_j`, a hash of the rows it used and its ELBO term
   (:class:`AuxSample`); the server checks the hashes, evaluates
   :math:`\\mathcal L_0 = \\log p(y\\mid z,\\gamma) + \\log p(\\gamma) - \\log q(\\gamma)`,
   steps :math:`q(\\gamma)` and keeps :math:`\\partial\\mathcal L_0/\\partial z_j`;
1. **update**: the server routes :math:`\\partial\\mathcal L_0/\\partial z_j` to party
   :math:`j` (:class:`AuxGrad`), which ascends :math:`\\langle
   \\mathrm{sg}(\\partial\\mathcal L_0/\\partial z_j), z_j\\rangle + \\mathcal L_j` with the
   *same* noise (a fresh draw would pair the server's gradient with another sample).

Algorithm 1 is not pipelined (the gradient riding on the next round's message):
that would leave the parties one update behind the server after every round, so a
round would no longer be one exact step of the joint ELBO's gradient.

Algorithm 2 (``kind="power"``) needs the labels at every party and takes three
phases: **send** (:math:`z_j`), **cross** (the server broadcasts every :math:`z_k`
and its draw of :math:`\\gamma`; each party replies the gradients of its likelihood
copy with respect to them, :class:`CrossGrads`, and its ELBO term; the server steps
:math:`q(\\gamma)` and sums :math:`\\sum_{k\\ne j}\\partial\\mathcal L_{0,k}/\\partial
z_j`), and **update**.

A silo's data are ``SiloData({party: view}, mask, unit_ids)``: the single key names
the party whose code runs (fixed when the function is traced), so one ``silo_step``
serves parties whose states differ in structure. A party may run another party's
code (parties of equal blocks vmapped together): its view and state are then given
under that party's names, and its ``slots`` say which real party each name stands
for.
"""

from contextlib import contextmanager
from typing import Any, Callable, NamedTuple
import warnings
import zlib

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.checks import check_count
from numpyro_fed.guard import guard_nonfinite
from numpyro_fed.protocol import FederatedAlgorithm, Message, SiloData
from numpyro_fed.util import ascent, tree_where
from numpyro_fed.vertical.augment import AugmentedModel, z_name
from numpyro_fed.vertical.data import row_hash
from numpyro_fed.vertical.families import VerticalFamily
from numpyro_fed.vertical.structure import (
    SERVER,
    VerticalStructure,
    fill_values,
    owner_log_density,
)
from numpyro_fed.vertical.terms import vertical_terms

__all__ = [
    "AuxGrad",
    "AuxSample",
    "CrossGrads",
    "RowIndexMismatchError",
    "VerticalBroadcast",
    "VerticalInfo",
    "VerticalPartyState",
    "VerticalServerState",
    "check_local_steps",
    "check_row_hashes",
    "name_key_data",
    "num_phases",
    "recording",
    "row_errors",
    "vertical_sfvi",
]


# ----------------------------------------------------------------- messages
class CrossGrads(NamedTuple):
    """Party :math:`j`'s likelihood-copy gradients (Algorithm 2, phase "cross").

    - **z** - ``(J, ...)``: row :math:`k` is
      :math:`\\partial\\mathcal L_{0,j}/\\partial z_k` (zero for :math:`k = j`).
    - **server_values** - :math:`\\partial\\mathcal L_{0,j}/\\partial\\gamma` (and the
      server's params).
    """

    z: jax.Array
    server_values: dict


class AuxSample(NamedTuple):
    """Party -> server (every phase; the server reads what the phase needs).

    - **z** - the party's auxiliary draw on this round's rows.
    - **row_hash** - a hash of the row indices the party used (``uint32``), or
      ``None`` in every round of a full-batch run.
    - **elbo** - the party's single-sample ELBO term (for the loss trace: one scalar
      per round beyond the paper's messages).
    - **cross** - :class:`CrossGrads` in Algorithm 2, ``()`` in Algorithm 1.
    """

    z: jax.Array
    row_hash: jax.Array | None = None
    elbo: jax.Array | None = None
    cross: Any = ()


class AuxGrad(NamedTuple):
    """Server -> party (routed): - **g** - :math:`\\partial\\mathcal L_0/\\partial z_j`
    (Algorithm 1) or :math:`\\sum_{k\\ne j}\\partial\\mathcal L_{0,k}/\\partial z_j`
    (Algorithm 2); zeros before the server has it."""

    g: jax.Array


class VerticalBroadcast(NamedTuple):
    """Server -> every party.

    - **phase** - the phase of this contract round (int32).
    - **idx** - the round's row indices (``None``: every row, every round).
    - **z** - Algorithm 2: ``(J, ...)``, every party's auxiliary (it reveals each
      party's :math:`z` to the others); ``()`` in Algorithm 1.
    - **server_values** - Algorithm 2: the server's draw of :math:`\\gamma` and its
      params, which every likelihood copy reads; ``{}`` in Algorithm 1.
    """

    phase: jax.Array
    idx: jax.Array | None
    z: Any
    server_values: dict


# -------------------------------------------------------------------- states
class VerticalPartyState(NamedTuple):
    """- **raw** - the party's unconstrained variational (and model) parameters.
    - **opt_state** - its optimizer's state.
    - **slots** - ``(J,)`` ints: the real party each party name stands for in the
      code this party runs (the identity unless it runs another party's code)."""

    raw: dict
    opt_state: Any
    slots: jax.Array


class VerticalServerState(NamedTuple):
    """- **raw** - the server's unconstrained parameters (:math:`q(\\gamma)`, params).
    - **opt_state** - its optimizer's state.
    - **phase** - the phase the next contract round runs (int32).
    - **grads** - ``(J, ...)``: the gradients routed in the update phase (this and
      the next two fields are zero between iterations).
    - **z** - Algorithm 2: the parties' auxiliaries of the round (``()`` otherwise).
    - **server_values** - Algorithm 2: the round's draw of :math:`\\gamma` (``{}``)."""

    raw: dict
    opt_state: Any
    phase: jax.Array
    grads: jax.Array
    z: Any
    server_values: dict


class VerticalInfo(NamedTuple):
    """- **loss** - the negative ELBO estimate of the round (zero in the phases that
      do not complete it).
    - **rejected** - ``(J,)`` booleans: parties whose reply was not finite; a round
      needs every party's auxiliary, so the server takes no step then.
    - **server_elbo** - the server's ELBO term.
    - **party_elbo** - ``(J,)``: each party's ELBO term."""

    loss: jax.Array
    rejected: jax.Array
    server_elbo: jax.Array
    party_elbo: jax.Array


class RowIndexMismatchError(RuntimeError):
    """Two parties (or a party and the server) used different rows in one round."""


@contextmanager
def row_errors():
    """Re-raise a row-index mismatch that the server detected inside a compiled round
    (a host callback's error) as :class:`RowIndexMismatchError`."""
    try:
        yield
    except jax.errors.JaxRuntimeError as err:
        text = str(err)
        tag = "RowIndexMismatchError: "
        if tag not in text:
            raise
        raise RowIndexMismatchError(
            text[text.rindex(tag) + len(tag) :].splitlines()[0]
        ) from None


def check_local_steps(local_steps: Any) -> int:
    """``local_steps`` as an int; more than one warns that the extra steps follow a
    linearization of the server's term."""
    local_steps = check_count("local_steps", local_steps)
    if local_steps > 1:
        warnings.warn(
            f"VerticalSFVI(local_steps={local_steps}): the extra local steps ascend "
            "the linearization <g_j, z_j> of the server's term around the round's "
            "z_j with a stale server gradient; only the first step follows the "
            "ELBO's gradient, so the fit is approximate.",
            UserWarning,
            stacklevel=3,
        )
    return local_steps


def num_phases(kind: str) -> int:
    """Contract rounds per iteration: 2 (Algorithm 1), 3 (Algorithm 2)."""
    return 2 if kind == "augmented" else 3


def name_key_data(name: str) -> int:
    """The ``fold_in`` datum of an owner's key: a CRC-32 of its name, so that a
    party's noise depends on its name only (not on its position, nor on the other
    parties' names). Python's ``hash`` is salted per process and cannot be used."""
    return zlib.crc32(name.encode())


def _raise_on_mismatch(server_hash: Any, hashes: dict) -> None:
    server_hash = np.asarray(server_hash)
    bad = sorted(p for p, h in hashes.items() if np.any(np.asarray(h) != server_hash))
    if bad:
        got = {p: np.asarray(hashes[p]).tolist() for p in bad}
        raise RowIndexMismatchError(
            f"Row-index hashes differ in this round: parties {bad} sent {got}, the "
            f"server's rows hash to {server_hash.tolist()}. Every party must use the "
            "row indices of the shared round key."
        )


def check_row_hashes(msgs: dict, idx: Any) -> None:
    """
    The server's check that every :class:`AuxSample` of a round was computed on its
    rows ``idx``: raises :class:`RowIndexMismatchError` naming the parties whose hash
    differs. Inside ``jit`` the check runs as a host callback when the round
    executes. A no-op when the round uses every row (``idx`` is ``None``).

    :param dict msgs: party -> :class:`AuxSample`.
    :param idx: the server's row indices of the round, or ``None``.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_fed.algorithms.vertical_sfvi import AuxSample, check_row_hashes
        >>> from numpyro_fed.vertical.data import row_hash
        >>> idx = jnp.array([3, 0, 2])
        >>> msgs = {"a": AuxSample(jnp.zeros(3), row_hash(idx)),
        ...         "b": AuxSample(jnp.zeros(3), row_hash(idx[::-1]))}
        >>> check_row_hashes(msgs, idx)
        Traceback (most recent call last):
        ...
        numpyro_fed.algorithms.vertical_sfvi.RowIndexMismatchError: Row-index hashes differ ... ['b'] ...
    """
    if idx is None:
        return
    expected = row_hash(idx)
    hashes = {p: m.row_hash for p, m in msgs.items()}
    missing = sorted(p for p, h in hashes.items() if h is None)
    if missing:
        raise RowIndexMismatchError(
            f"Parties {missing} sent no row-index hash in a subsampled round."
        )
    leaves = jax.tree.leaves((expected, hashes))
    if any(isinstance(x, jax.core.Tracer) for x in leaves):
        jax.debug.callback(_raise_on_mismatch, expected, hashes)
    else:
        _raise_on_mismatch(expected, hashes)


def _sg(tree: Any) -> Any:
    return lax.stop_gradient(tree)


def vertical_sfvi(
    model: AugmentedModel,
    family: VerticalFamily,
    structure: VerticalStructure,
    optims: dict,
    server_view: dict,
    *,
    stl: bool = True,
    local_steps: int = 1,
    noise: Callable | None = None,
) -> FederatedAlgorithm:
    """
    Vertical SFVI for ``model`` (Algorithm 1 for ``kind="augmented"``, Algorithm 2
    for ``kind="power"``); one iteration is :func:`num_phases` contract rounds run in
    order with the same server and silo keys. Silo ``j`` is party
    ``structure.parties[j]``. The server's key is the round's key, from which it
    derives its noise and the round's rows; in simulation the parties' keys are
    derived from it too (:func:`name_key_data`), which a deployment would not do.

    :param AugmentedModel model: from :func:`~numpyro_fed.augment`.
    :param VerticalFamily family: set up on ``structure``.
    :param VerticalStructure structure: from ``vertical_structure``.
    :param dict optims: owner (each party and ``"server"``) -> optax optimizer.
    :param dict server_view: the server's view of the data (its labels).
    :param bool stl: sticking-the-landing (``log q`` with stop-gradient parameters).
    :param int local_steps: optimizer steps a party takes per update on
        :math:`\\langle \\mathrm{sg}(g_j), z_j\\rangle + \\mathcal L_j` with the
        server's gradient :math:`g_j` and the round's noise held fixed. ``1`` is
        Algorithm 1/2; more steps optimize the server term's linearization, which is
        exact only for the first step (an approximation).
    :param callable noise: ``(owner, key) -> (eps, tau)`` (default
        :func:`~numpyro_fed.vertical.terms.standard_noise`).
    :rtype: FederatedAlgorithm
    """
    local_steps = check_count("local_steps", local_steps)
    parties = structure.parties
    num = len(parties)
    shapes = {structure.z_shape[p] for p in parties}
    if len(shapes) != 1:
        raise NotImplementedError(
            "The parties' auxiliaries have different shapes "
            f"{dict(structure.z_shape)}: the messages stack them by party."
        )
    z_shape = (num,) + shapes.pop()
    rows = structure.rows
    subsampled = rows is not None and rows[2] < rows[1]
    power = structure.kind == "power"
    terms = vertical_terms(model, family, structure, server_view, stl=stl, noise=noise)
    server_noise = name_key_data(SERVER)

    def round_rows(key):
        if not subsampled:
            return None
        return jax.random.choice(jax.random.fold_in(key, 0), rows[1], (rows[2],), False)

    def init_server(key: jax.Array) -> VerticalServerState:
        raw = family.init(SERVER, key)
        values = {}
        if power:
            shapes = jax.eval_shape(terms.server_values, raw, key)[0]
            values = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        zeros = jnp.zeros(z_shape)
        return VerticalServerState(
            raw,
            optims[SERVER].init(raw),
            jnp.zeros((), jnp.int32),
            zeros,
            zeros if power else (),
            values,
        )

    def init_silo(key: jax.Array, data: SiloData) -> VerticalPartyState:
        ((party, view),) = data.arrays.items()
        raw = family.init(party, key)
        if family.aux == "meanfield":  # start q(z_j) at the prior mean
            raw = family.init(party, key, terms.contribution(party, raw, view))
        return VerticalPartyState(
            raw, optims[party].init(raw), jnp.arange(num, dtype=jnp.int32)
        )

    def server_message(state: VerticalServerState, key: jax.Array) -> Message:
        broadcast = VerticalBroadcast(
            state.phase, round_rows(key), state.z, state.server_values
        )
        return Message(broadcast, AuxGrad(state.grads))

    def silo_step(message: Message, state: VerticalPartyState, data: SiloData, key):
        ((party, view),) = data.arrays.items()
        b, g = message.broadcast, message.routed.g
        idx = b.idx
        hashed = None if idx is None else row_hash(idx)
        own = parties.index(party)
        no_cross: CrossGrads | tuple[()] = ()
        if power:
            no_cross = CrossGrads(
                jnp.zeros(z_shape), jax.tree.map(jnp.zeros_like, b.server_values)
            )

        def named_others(state):
            return {parties[i]: b.z[state.slots[i]] for i in range(num) if i != own}

        def extra(state):
            if not power:
                return {}
            others = {z_name(k): v for k, v in named_others(state).items()}
            return {**others, **b.server_values}

        def send(state):
            if power:  # the ELBO term needs the others' z: reported in "cross"
                z = terms.party_draw(party, state.raw, view, key, idx)[0]
                elbo = jnp.zeros(())
            else:
                z, elbo = terms.party_elbo(party, state.raw, view, key, idx, {})
            return AuxSample(z, hashed, elbo, no_cross), state

        def cross(state):
            _, values, _ = terms.party_draw(party, _sg(state.raw), view, key, idx)

            def copy_term(others, server):
                known = {**{z_name(k): v for k, v in others.items()}, **server}
                full = fill_values(structure, {**known, **values})
                return owner_log_density(model, party, full, view)

            g_z, g_s = jax.grad(copy_term, argnums=(0, 1))(
                named_others(state), b.server_values
            )
            by_party = jnp.zeros(z_shape)
            for k, v in g_z.items():
                by_party = by_party.at[state.slots[parties.index(k)]].set(v)
            z, elbo = terms.party_elbo(party, state.raw, view, key, idx, extra(state))
            return AuxSample(z, hashed, elbo, CrossGrads(by_party, g_s)), state

        def update(state):
            known = extra(state)

            def surrogate(raw):
                z, elbo = terms.party_elbo(party, raw, view, key, idx, known)
                return jnp.sum(_sg(g) * z) + elbo, (z, elbo)

            def step(carry):
                g_raw, out = jax.grad(surrogate, has_aux=True)(carry[0])
                return ascent(optims[party], g_raw, carry[1], carry[0]), out

            carry, (z, elbo) = step((state.raw, state.opt_state))
            if local_steps > 1:  # the same noise and server gradient: a linearization
                carry = lax.fori_loop(
                    0, local_steps - 1, lambda _, c: step(c)[0], carry
                )
            new = VerticalPartyState(*carry, state.slots)
            return AuxSample(z, hashed, elbo, no_cross), new

        branches = [send, cross, update] if power else [send, update]
        return _switch(b.phase, branches, state)

    def server_step(state: VerticalServerState, replies: AuxSample, key, participating):
        idx = round_rows(key)
        skey = jax.random.fold_in(key, server_noise)
        nothing = jnp.zeros((num,), bool)

        def info(elbo0=None, elbos=None):
            elbo0 = jnp.zeros(()) if elbo0 is None else elbo0
            elbos = jnp.zeros((num,)) if elbos is None else elbos
            return VerticalInfo(-(elbo0 + jnp.sum(elbos)), nothing, elbo0, elbos)

        def checked(state):
            check_row_hashes(
                {
                    p: AuxSample(replies.z[j], _row(replies.row_hash, j))
                    for j, p in enumerate(parties)
                },
                idx,
            )
            return state

        def send(state):  # Algorithm 1: the server's step and the parties' gradients
            state = checked(state)
            zs = {p: replies.z[j] for j, p in enumerate(parties)}
            (_, elbo0), (g_raw, g_z) = jax.value_and_grad(
                lambda raw, zs: terms.server_term(raw, zs, skey, idx),
                argnums=(0, 1),
                has_aux=True,
            )(state.raw, zs)
            raw, opt_state = ascent(optims[SERVER], g_raw, state.opt_state, state.raw)
            grads = jnp.stack([g_z[p] for p in parties])
            new = state._replace(raw=raw, opt_state=opt_state, phase=state.phase + 1)
            return new._replace(grads=grads), info(elbo0, replies.elbo)

        def collect(state):  # Algorithm 2, phase 0: keep the zs and the gamma draw
            state = checked(state)
            values = terms.server_values(state.raw, skey)[0]
            new = state._replace(z=replies.z, server_values=values)
            return new._replace(phase=state.phase + 1), info()

        def cross(state):  # Algorithm 2, phase 1: the server's step, the sums
            linear = jax.tree.map(lambda x: jnp.sum(x, 0), replies.cross.server_values)
            g_raw, elbo0 = jax.grad(
                lambda raw: terms.server_term(raw, {}, skey, idx, linear),
                has_aux=True,
            )(state.raw)
            raw, opt_state = ascent(optims[SERVER], g_raw, state.opt_state, state.raw)
            grads = jnp.sum(replies.cross.z, 0)  # own rows are zero
            new = state._replace(raw=raw, opt_state=opt_state, grads=grads)
            return new._replace(phase=state.phase + 1), info(elbo0, replies.elbo)

        def update(state):  # the round's per-row buffers are spent: clear them
            return jax.tree.map(jnp.zeros_like, state)._replace(
                raw=state.raw, opt_state=state.opt_state
            ), info()

        branches = [collect, cross, update] if power else [send, update]
        new, out = _switch(state.phase, branches, state)
        # The likelihood needs every party's z_j: a round that misses a party's reply
        # (a node that left) leaves the server as it was, to repeat the phase.
        return tree_where(jnp.all(participating), new, state), out

    return guard_nonfinite(
        FederatedAlgorithm(
            init_server, init_silo, server_message, silo_step, server_step
        ),
        all_or_nothing=True,
    )


def _switch(index: Any, branches: list, *args: Any) -> Any:
    """``lax.switch``, or the one branch when ``index`` is known at trace time (a
    runtime that runs the phases in order compiles each phase's branch only)."""
    if isinstance(index, jax.core.Tracer):
        return lax.switch(index, branches, *args)
    return branches[int(index)](*args)


def _row(tree: Any, j: int) -> Any:
    return None if tree is None else tree[j]


def recording(
    algorithm: FederatedAlgorithm, kind: str, log: list
) -> FederatedAlgorithm:
    """
    ``algorithm`` whose party step appends what crosses the wire to ``log`` as
    ``(index, sender, receiver, message)`` when run eagerly (the sequential
    runtime): in each phase only the parts it uses (the update phase's routed part;
    in the other phases the broadcast, after the first, and the reply).
    """
    update = num_phases(kind) - 1

    def silo_step(message, state, data, key):
        reply, state = algorithm.silo_step(message, state, data, key)
        if not isinstance(message.broadcast.phase, jax.core.Tracer):
            ((party, _),) = data.arrays.items()
            phase = int(message.broadcast.phase)
            sent = [(SERVER, party, message.routed)] if phase == update else []
            if phase != update:
                if phase > 0:
                    sent.append((SERVER, party, message.broadcast))
                sent.append((party, SERVER, reply))
            log.extend((len(log) + i, *m) for i, m in enumerate(sent))
        return reply, state

    return algorithm._replace(silo_step=silo_step)
