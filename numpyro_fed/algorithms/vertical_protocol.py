# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The pure protocol of vertical federated VI (Hassan et al. seed 003, Algorithms 1
and 2): message and state types, and :func:`vertical_sfvi`, the functions a party and
the server run in a round. :class:`~numpyro_fed.VerticalSFVI` drives them under a
runtime.

Each round (Algorithm 1, augmented-variable model):

1. party :math:`j` draws :math:`(\\theta_j, z_j)` from its own :math:`q` with noise it
   keeps, and sends :math:`z_j` and a hash of the rows it used (:class:`AuxSample`);
2. the server checks that every party used the server's rows (the hashes agree), evaluates
   :math:`\\mathcal L_0 = \\log p(y\\mid z,\\gamma) + \\log p(\\gamma) - \\log q(\\gamma)`,
   returns :math:`\\partial\\mathcal L_0/\\partial z_j` to each party (:class:`AuxGrad`)
   and updates :math:`q(\\gamma)`;
3. party :math:`j` ascends :math:`\\langle \\mathrm{sg}(\\partial\\mathcal L_0/\\partial
   z_j), z_j\\rangle + \\mathcal L_j` with the *same* noise (a fresh draw would pair
   the server's gradient with another sample and bias the estimate), using its own
   optimizer.

Algorithm 2 (power likelihood) needs the labels at every party: the server
broadcasts every :math:`z_k` and its own draw of :math:`\\gamma`
(:class:`AuxBroadcast`), each party returns the gradients of its likelihood copy
with respect to them (:class:`CrossGrads`), and the server sums
:math:`\\sum_{k\\ne j}\\partial\\mathcal L_{0,k}/\\partial z_j` for party :math:`j`.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers
import optax

from numpyro_fed.vertical.augment import AugmentedModel, z_name
from numpyro_fed.vertical.data import row_hash
from numpyro_fed.vertical.families import VerticalFamily
from numpyro_fed.vertical.structure import (
    SERVER,
    VerticalStructure,
    fill_values,
    owner_log_density,
)

__all__ = [
    "AuxBroadcast",
    "AuxGrad",
    "AuxSample",
    "CrossGrads",
    "RowIndexMismatchError",
    "VerticalAlgorithm",
    "VerticalParams",
    "VerticalPartyState",
    "VerticalSFVIState",
    "VerticalServerState",
    "check_row_hashes",
    "standard_noise",
    "vertical_sfvi",
]


# ----------------------------------------------------------------- messages
class AuxSample(NamedTuple):
    """Party -> server.

    - **z** - the party's auxiliary draw on this round's rows.
    - **row_hash** - a hash of the row indices the party used (``uint32``), or
      ``None`` when every round uses every row.
    """

    z: jax.Array
    row_hash: jax.Array | None = None


class AuxGrad(NamedTuple):
    """Server -> party: - **g** - :math:`\\partial\\mathcal L_0/\\partial z_j` (Algorithm
    1) or :math:`\\sum_{k\\ne j}\\partial\\mathcal L_{0,k}/\\partial z_j` (Algorithm 2)."""

    g: jax.Array


class AuxBroadcast(NamedTuple):
    """Server -> every party (Algorithm 2 only; it reveals each party's :math:`z` to
    the others).

    - **z** - party -> its auxiliary draw.
    - **server_values** - the server's draw of its latents :math:`\\gamma` and its
      ``numpyro.param`` values, which every likelihood copy reads.
    """

    z: dict
    server_values: dict


class CrossGrads(NamedTuple):
    """Party :math:`j` -> server (Algorithm 2 only).

    - **z** - party :math:`k\\ne j` -> :math:`\\partial\\mathcal L_{0,j}/\\partial z_k`.
    - **server_values** - :math:`\\partial\\mathcal L_{0,j}/\\partial\\gamma` (and the
      server's params).
    """

    z: dict
    server_values: dict


# -------------------------------------------------------------------- states
class VerticalPartyState(NamedTuple):
    """- **raw** - the party's unconstrained variational (and model) parameters.
    - **opt_state** - its optimizer's state."""

    raw: dict
    opt_state: Any


class VerticalServerState(NamedTuple):
    """- **raw** - the server's unconstrained parameters (:math:`q(\\gamma)`, params).
    - **opt_state** - its optimizer's state."""

    raw: dict
    opt_state: Any


class VerticalSFVIState(NamedTuple):
    """- **server** - :class:`VerticalServerState`.
    - **parties** - party -> :class:`VerticalPartyState`.
    - **rng_key** - the key the next round splits."""

    server: VerticalServerState
    parties: dict
    rng_key: jax.Array


class VerticalParams(NamedTuple):
    """Constrained parameters by owner (see :meth:`VerticalFamily.constrain`).

    - **server** - ``loc``, ``scale_tril``/``scale`` of :math:`q(\\gamma)`, ``param``.
    - **parties** - party -> ``loc``, ``scale_tril``/``scale``, ``z_loc``/``z_scale``
      or ``net``, ``param``.
    """

    server: dict
    parties: dict


class VerticalAlgorithm(NamedTuple):
    """The pure functions of a round (``party`` is a static party name).

    - **party_send** - ``(party, state, view, key, idx) -> AuxSample``.
    - **server_step** - Algorithm 1: ``(state, {party: AuxSample}, view, key, idx) ->
      (state, {party: AuxGrad}, server_elbo)``.
    - **server_broadcast** - Algorithm 2: ``(state, {party: AuxSample}, key, idx)
      -> AuxBroadcast``.
    - **party_cross** - Algorithm 2: ``(party, state, view, key, idx, broadcast) ->
      CrossGrads``.
    - **server_collect** - Algorithm 2: ``(state, view, key, idx, broadcast,
      {party: CrossGrads}) -> (state, {party: AuxGrad}, server_elbo)``.
    - **party_update** - ``(party, state, view, key, idx, AuxGrad, broadcast or None)
      -> (state, party_elbo)``.
    - **party_elbo** - ``(party, raw, view, key, idx, extra) -> (z, elbo)``: the
      party's auxiliary and its single-sample ELBO term, other owners' values from
      ``extra`` (placeholders for the rest).
    """

    party_send: Callable
    server_step: Callable
    server_broadcast: Callable
    party_cross: Callable
    server_collect: Callable
    party_update: Callable
    party_elbo: Callable


class RowIndexMismatchError(RuntimeError):
    """Two parties (or a party and the server) used different rows in one round."""


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
        >>> from numpyro_fed.algorithms.vertical_protocol import AuxSample, check_row_hashes
        >>> from numpyro_fed.vertical.data import row_hash
        >>> idx = jnp.array([3, 0, 2])
        >>> msgs = {"a": AuxSample(jnp.zeros(3), row_hash(idx)),
        ...         "b": AuxSample(jnp.zeros(3), row_hash(idx[::-1]))}
        >>> check_row_hashes(msgs, idx)
        Traceback (most recent call last):
        ...
        numpyro_fed.algorithms.vertical_protocol.RowIndexMismatchError: Row-index hashes differ ... ['b'] ...
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
    return jax.lax.stop_gradient(tree)


def _ascend(optim, grads, opt_state, raw):
    # optax minimizes: hand it the gradient of the negative ELBO.
    updates, opt_state = optim.update(jax.tree.map(jnp.negative, grads), opt_state, raw)
    return optax.apply_updates(raw, updates), opt_state


def standard_noise(family: VerticalFamily, structure: VerticalStructure) -> Callable:
    """
    The default reparameterization noise of a round: ``(owner, key) -> (eps, tau)``,
    standard normals for :math:`q(\\theta)` (shape ``(dim,)``) and, for a party, for
    its auxiliary (shape ``z_shape``, one entry per row *position*: permuting the
    rows does not permute it). A custom ``noise`` for :func:`vertical_sfvi` can wrap
    it.

    :param VerticalFamily family: set up on ``structure``.
    :param VerticalStructure structure: the model's structure.
    """

    def noise(owner, key):
        k1, k2 = jax.random.split(key)
        eps = jax.random.normal(k1, (family.dim(owner),))
        if owner == SERVER:
            return eps, None
        return eps, jax.random.normal(k2, structure.z_shape[owner])

    return noise


def vertical_sfvi(
    model: AugmentedModel,
    family: VerticalFamily,
    structure: VerticalStructure,
    optims: dict,
    *,
    stl: bool = True,
    local_steps: int = 1,
    noise: Callable | None = None,
) -> VerticalAlgorithm:
    """
    The pure functions of vertical SFVI for ``model`` (Algorithm 1 for
    ``kind="augmented"``, Algorithm 2 for ``kind="power"``).

    :param AugmentedModel model: from :func:`~numpyro_fed.augment`.
    :param VerticalFamily family: set up on ``structure``.
    :param VerticalStructure structure: from :func:`vertical_structure`.
    :param dict optims: owner (each party and ``"server"``) -> optax optimizer.
    :param bool stl: sticking-the-landing (``log q`` with stop-gradient parameters).
    :param int local_steps: optimizer steps a party takes per round on
        :math:`\\langle \\mathrm{sg}(g_j), z_j\\rangle + \\mathcal L_j` with the
        server's gradient :math:`g_j` and the round's noise held fixed. ``1`` is
        Algorithm 1/2; more steps optimize the server term's linearization, which is
        exact only for the first step (an approximation).
    :param callable noise: ``(owner, key) -> (eps, tau)``, the reparameterization
        noise of :math:`q(\\theta)` (shape ``(dim,)``) and of the auxiliary (its shape;
        ``None`` for the server). Default: standard normals drawn from ``key``.
    :rtype: VerticalAlgorithm
    """
    if not isinstance(local_steps, int) or isinstance(local_steps, bool):
        raise TypeError(f"local_steps must be an int, got {local_steps!r}.")
    if local_steps < 1:
        raise ValueError(f"local_steps must be >= 1, got {local_steps}.")
    parties = structure.parties
    rows = structure.rows
    subsampled = rows is not None and rows[2] < rows[1]

    def rows_values(idx):
        return {rows[0]: idx} if subsampled else {}

    noise = noise or standard_noise(family, structure)

    def probe(party, values, view):
        seeded = handlers.seed(
            handlers.substitute(model.run, data=fill_values(structure, values)),
            jax.random.key(0),
        )
        _, h = seeded("probe", **view)
        y = None
        if family.aux == "amortized" and model.kind == "power":
            if len(h.likelihood) != 1:
                raise NotImplementedError(
                    "The amortized power-likelihood family feeds y to its network and "
                    "needs exactly one likelihood site; got "
                    f"{sorted(h.likelihood)}."
                )
            y = next(iter(h.likelihood.values()))["value"]
        return h.contributions[party], y

    def party_draw(party, raw, view, key, idx):
        """``(z_j, site values, log q)`` with the noise of ``key``."""
        p = family.constrain(party, raw)
        p_q = _sg(p) if stl else p
        eps, tau = noise(party, key)
        values, log_q = family.draw_latents(party, p, p_q, eps)
        values = {**values, **p["param"], **rows_values(idx)}
        u, y = probe(party, values, view)
        z_loc = family.z_dist(party, p, u, y, idx)
        z = z_loc.loc + z_loc.scale * tau
        log_q_z = family.z_dist(party, p_q, u, y, idx).log_prob(z).sum()
        values[z_name(party)] = z
        return z, values, log_q + structure.z_scale * log_q_z

    def party_elbo(party, raw, view, key, idx, extra):
        z, values, log_q = party_draw(party, raw, view, key, idx)
        values = fill_values(structure, {**extra, **values})
        return z, owner_log_density(model, party, values, view) - log_q

    def server_values(raw, key):
        p = family.constrain(SERVER, raw)
        p_q = _sg(p) if stl else p
        eps, _ = noise(SERVER, key)
        values, log_q = family.draw_latents(SERVER, p, p_q, eps)
        return {**values, **p["param"]}, log_q

    def server_term(raw, zs, view, key, idx, linear=None):
        values, log_q = server_values(raw, key)
        full = {**values, **{z_name(k): v for k, v in zs.items()}, **rows_values(idx)}
        elbo = owner_log_density(model, SERVER, fill_values(structure, full), view)
        elbo = elbo - log_q
        if linear is not None:  # Algorithm 2: the copies' gradients w.r.t. gamma
            surrogate = sum(
                jnp.sum(linear[k] * values[k]) for k in linear if k in values
            )
            return elbo + surrogate - _sg(surrogate), elbo
        return elbo, elbo

    # ------------------------------------------------------------- functions
    def party_send(party, state, view, key, idx):
        z = party_draw(party, state.raw, view, key, idx)[0]
        return AuxSample(z, None if idx is None else row_hash(idx))

    def server_step(state, msgs, view, key, idx):
        check_row_hashes(msgs, idx)
        zs = {k: m.z for k, m in msgs.items()}

        def objective(raw, zs):
            return server_term(raw, zs, view, key, idx)

        (_, elbo), (g_raw, g_z) = jax.value_and_grad(
            objective, argnums=(0, 1), has_aux=True
        )(state.raw, zs)
        raw, opt_state = _ascend(optims[SERVER], g_raw, state.opt_state, state.raw)
        grads = {k: AuxGrad(g_z[k]) for k in parties}
        return VerticalServerState(raw, opt_state), grads, elbo

    def server_broadcast(state, msgs, key, idx=None):
        check_row_hashes(msgs, idx)
        values, _ = server_values(state.raw, key)
        return AuxBroadcast({k: m.z for k, m in msgs.items()}, values)

    def party_cross(party, state, view, key, idx, broadcast):
        _, own, _ = party_draw(party, _sg(state.raw), view, key, idx)
        others = {k: v for k, v in broadcast.z.items() if k != party}

        def copy_term(others, server):
            extra = {**{z_name(k): v for k, v in others.items()}, **server}
            values = fill_values(structure, {**extra, **own})
            return owner_log_density(model, party, values, view)

        g_z, g_s = jax.grad(copy_term, argnums=(0, 1))(others, broadcast.server_values)
        return CrossGrads(g_z, g_s)

    def server_collect(state, view, key, idx, broadcast, cross):
        linear = {}
        for g in cross.values():
            for k, v in g.server_values.items():
                linear[k] = linear.get(k, 0.0) + v

        def objective(raw):
            return server_term(raw, {}, view, key, idx, linear)

        g_raw, elbo = jax.grad(objective, has_aux=True)(state.raw)
        raw, opt_state = _ascend(optims[SERVER], g_raw, state.opt_state, state.raw)
        grads = {
            j: AuxGrad(sum(cross[k].z[j] for k in parties if k != j))
            if len(parties) > 1
            else AuxGrad(jnp.zeros(structure.z_shape[j]))
            for j in parties
        }
        return VerticalServerState(raw, opt_state), grads, elbo

    def party_update(party, state, view, key, idx, grad, broadcast=None):
        extra = {}
        if broadcast is not None:
            extra = {z_name(k): v for k, v in broadcast.z.items() if k != party}
            extra.update(broadcast.server_values)

        def surrogate(raw):
            z, elbo = party_elbo(party, raw, view, key, idx, extra)
            return jnp.sum(_sg(grad.g) * z) + elbo, elbo

        def step(carry):
            g_raw, elbo = jax.grad(surrogate, has_aux=True)(carry[0])
            return _ascend(optims[party], g_raw, carry[1], carry[0]), elbo

        carry, elbo = step((state.raw, state.opt_state))
        if local_steps > 1:  # the same noise and server gradient: a linearization
            carry = jax.lax.fori_loop(
                0, local_steps - 1, lambda _, c: step(c)[0], carry
            )
        return VerticalPartyState(*carry), elbo

    return VerticalAlgorithm(
        party_send,
        server_step,
        server_broadcast,
        party_cross,
        server_collect,
        party_update,
        party_elbo,
    )
