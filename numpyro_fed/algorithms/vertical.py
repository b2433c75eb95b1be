# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Vertical federated VI (Hassan et al. seed 003, Algorithms 1 and 2).

Parties hold different columns of the same rows; the server holds the labels.
Each round (Algorithm 1, augmented-variable model):

1. party :math:`j` draws :math:`(\\theta_j, z_j)` from its own :math:`q` with noise it
   keeps, and sends :math:`z_j` (:class:`AuxSample`: one number per row);
2. the server evaluates :math:`\\mathcal L_0 = \\log p(y\\mid z,\\gamma) + \\log p(\\gamma)
   - \\log q(\\gamma)`, returns :math:`\\partial\\mathcal L_0/\\partial z_j` to each
   party (:class:`AuxGrad`) and updates :math:`q(\\gamma)`;
3. party :math:`j` ascends :math:`\\langle \\mathrm{sg}(\\partial\\mathcal L_0/\\partial
   z_j), z_j\\rangle + \\mathcal L_j` with the *same* noise (a fresh draw would pair
   the server's gradient with another sample and bias the estimate), using its own
   optimizer.

Algorithm 2 (power likelihood) needs the labels at every party: the server
broadcasts every :math:`z_k` and its own draw of :math:`\\gamma`
(:class:`AuxBroadcast`), each party returns the gradients of its likelihood copy
with respect to them (:class:`CrossGrads`), and the server sums
:math:`\\sum_{k\\ne j}\\partial\\mathcal L_{0,k}/\\partial z_j` for party :math:`j`.

The pure functions of :func:`vertical_sfvi` are driven by :class:`VerticalSFVI`
under two runtimes: ``"simulate"`` (one jitted round, parties unrolled in it) and
``"sequential"`` (each party's step jitted on its own and called in turn, with
every message materialized and optionally recorded).
"""

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro import handlers
import numpyro.distributions as dist
from numpyro.distributions import biject_to
from numpyro.infer.util import log_density
import optax

from numpyro_fed.algorithms._runner import RunResult, run_loop
from numpyro_fed.vertical.augment import AugmentedModel, VerticalModelError, z_name
from numpyro_fed.vertical.data import VerticalData
from numpyro_fed.vertical.families import VerticalFamily
from numpyro_fed.vertical.structure import (
    SERVER,
    VerticalStructure,
    fill_values,
    owner_log_density,
    vertical_structure,
)

__all__ = [
    "AuxBroadcast",
    "AuxGrad",
    "AuxSample",
    "CrossGrads",
    "VerticalAlgorithm",
    "VerticalParams",
    "VerticalPartyState",
    "VerticalSFVI",
    "VerticalSFVIState",
    "VerticalServerState",
    "vertical_sfvi",
]


# ----------------------------------------------------------------- messages
class AuxSample(NamedTuple):
    """Party -> server: - **z** - the party's auxiliary draw on this round's rows."""

    z: jax.Array


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
    - **server_broadcast** - Algorithm 2: ``(state, {party: AuxSample}, key) ->
      AuxBroadcast``.
    - **party_cross** - Algorithm 2: ``(party, state, view, key, idx, broadcast) ->
      CrossGrads``.
    - **server_collect** - Algorithm 2: ``(state, view, key, idx, broadcast,
      {party: CrossGrads}) -> (state, {party: AuxGrad}, server_elbo)``.
    - **party_update** - ``(party, state, view, key, idx, AuxGrad, broadcast or None)
      -> (state, party_elbo)``.
    """

    party_send: Callable
    server_step: Callable
    server_broadcast: Callable
    party_cross: Callable
    server_collect: Callable
    party_update: Callable


def _sg(tree: Any) -> Any:
    return jax.lax.stop_gradient(tree)


def _ascend(optim, grads, opt_state, raw):
    # optax minimizes: hand it the gradient of the negative ELBO.
    updates, opt_state = optim.update(jax.tree.map(jnp.negative, grads), opt_state, raw)
    return optax.apply_updates(raw, updates), opt_state


def vertical_sfvi(
    model: AugmentedModel,
    family: VerticalFamily,
    structure: VerticalStructure,
    optims: dict,
    *,
    stl: bool = True,
) -> VerticalAlgorithm:
    """
    The pure functions of vertical SFVI for ``model`` (Algorithm 1 for
    ``kind="augmented"``, Algorithm 2 for ``kind="power"``).

    :param AugmentedModel model: from :func:`~numpyro_fed.augment`.
    :param VerticalFamily family: set up on ``structure``.
    :param VerticalStructure structure: from :func:`vertical_structure`.
    :param dict optims: owner (each party and ``"server"``) -> optax optimizer.
    :param bool stl: sticking-the-landing (``log q`` with stop-gradient parameters).
    :rtype: VerticalAlgorithm
    """
    parties = structure.parties
    rows = structure.rows
    subsampled = rows is not None and rows[2] < rows[1]

    def rows_values(idx):
        return {rows[0]: idx} if subsampled else {}

    def noise(owner, key):
        k1, k2 = jax.random.split(key)
        eps = jax.random.normal(k1, (family.dim(owner),))
        if owner == SERVER:
            return eps, None
        return eps, jax.random.normal(k2, structure.z_shape[owner])

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
        return AuxSample(party_draw(party, state.raw, view, key, idx)[0])

    def server_step(state, msgs, view, key, idx):
        zs = {k: m.z for k, m in msgs.items()}

        def objective(raw, zs):
            return server_term(raw, zs, view, key, idx)

        (_, elbo), (g_raw, g_z) = jax.value_and_grad(
            objective, argnums=(0, 1), has_aux=True
        )(state.raw, zs)
        raw, opt_state = _ascend(optims[SERVER], g_raw, state.opt_state, state.raw)
        grads = {k: AuxGrad(g_z[k]) for k in parties}
        return VerticalServerState(raw, opt_state), grads, elbo

    def server_broadcast(state, msgs, key):
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

        g_raw, elbo = jax.grad(surrogate, has_aux=True)(state.raw)
        raw, opt_state = _ascend(optims[party], g_raw, state.opt_state, state.raw)
        return VerticalPartyState(raw, opt_state), elbo

    return VerticalAlgorithm(
        party_send,
        server_step,
        server_broadcast,
        party_cross,
        server_collect,
        party_update,
    )


class _Round(NamedTuple):
    idx: Any
    server_key: jax.Array
    party_keys: dict


class VerticalSFVI:
    """
    Vertical federated VI on an augmented model (Hassan et al. seed 003,
    Algorithm 1 for ``kind="augmented"``, Algorithm 2 for ``kind="power"``), with the
    API of NumPyro's ``SVI``: ``init / update / run / get_params /
    sample_posterior``.

    Messages of Algorithm 1 carry only :math:`z_j` and
    :math:`\\partial\\mathcal L_0/\\partial z_j` (one number per row and party per
    round); :math:`x_j`, :math:`\\theta_j` and :math:`x_j\\theta_j` never leave party
    :math:`j`. :math:`z_j` is itself a noisy per-row projection of :math:`x_j`, and the
    server's gradient is a function of the labels: see ``docs/vertical-fl.md``.

    :param AugmentedModel model: ``nf.augment(model, rho, kind)``.
    :param VerticalFamily family: the variational family.
    :param optim: an optax optimizer for every owner, or a dict owner (each party and
        ``"server"``) -> optimizer: each party updates with its own.
    :param bool stl: sticking-the-landing gradients.
    :param str runtime: ``"simulate"`` (one jitted round) or ``"sequential"`` (one
        party at a time, messages materialized).
    :param bool record_messages: with the sequential runtime, keep every message in
        ``self.messages`` as ``(round, sender, receiver, message)``.

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp, optax
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(x1, x2, y=None):
        ...     with nf.vertical("a"):
        ...         b1 = numpyro.sample("b1", dist.Normal(0, 1))
        ...         e1 = nf.contribution("a", x1 * b1)
        ...     with nf.vertical("b"):
        ...         b2 = numpyro.sample("b2", dist.Normal(0, 1))
        ...         e2 = nf.contribution("b", x2 * b2)
        ...     with numpyro.plate("rows", x1.shape[0]):
        ...         numpyro.sample("y", dist.Normal(e1 + e2, 0.5), obs=y)
        >>> x1, x2 = jnp.linspace(-1, 1, 20), jnp.cos(jnp.arange(20.0))
        >>> data = nf.VerticalData({"a": {"x1": x1}, "b": {"x2": x2}}, {"y": x1 - x2})
        >>> vfl = nf.VerticalSFVI(nf.augment(model, 0.1), nf.VerticalFamily(), optax.adam(0.05))
        >>> structure = vfl.setup(data)  # what init traces; run(key, steps, data) fits
        >>> structure.parties, structure.z_shape["a"]
        (('a', 'b'), (20,))
    """

    def __init__(
        self,
        model: AugmentedModel,
        family: VerticalFamily,
        optim: Any,
        *,
        stl: bool = True,
        runtime: str = "simulate",
        record_messages: bool = False,
    ) -> None:
        if not isinstance(model, AugmentedModel):
            raise TypeError(
                "VerticalSFVI needs an augmented model: nf.augment(model, rho, kind); "
                f"got {type(model).__name__}."
            )
        if not isinstance(family, VerticalFamily):
            raise TypeError(
                f"family must be a VerticalFamily, got {type(family).__name__}."
            )
        if runtime not in ("simulate", "sequential"):
            raise ValueError(
                f"runtime must be 'simulate' or 'sequential', got {runtime!r}."
            )
        optims = optim if isinstance(optim, dict) else None
        if optims is None and not isinstance(optim, optax.GradientTransformation):
            raise TypeError(
                "optim must be an optax.GradientTransformation or a dict owner -> "
                f"optimizer; got {type(optim).__name__}."
            )
        self.model = model
        self.family = family
        self.optim = optim
        self.stl = stl
        self.runtime = runtime
        self.record_messages = record_messages
        self.messages: list = []
        self.structure: VerticalStructure | None = None
        self._layout: tuple = ()
        self._built: dict = {}

    # ------------------------------------------------------------ construction
    def _optims(self) -> dict:
        owners = self.structure.parties + (SERVER,)
        if not isinstance(self.optim, dict):
            return {o: self.optim for o in owners}
        missing = [o for o in owners if o not in self.optim]
        if missing:
            raise ValueError(
                f"optim has no optimizer for {missing} (owners: {owners})."
            )
        for o, opt in self.optim.items():
            if not isinstance(opt, optax.GradientTransformation):
                raise TypeError(f"optim[{o!r}] is not an optax GradientTransformation.")
        return dict(self.optim)

    def setup(self, data: VerticalData) -> VerticalStructure:
        """Trace the model on ``data`` and bind the family (done by :meth:`init`)."""
        if not isinstance(data, VerticalData):
            raise TypeError(
                f"data must be a nf.VerticalData, got {type(data).__name__}."
            )
        layout = (data.labels, data.parties) + tuple(
            (k, v.shape, str(v.dtype)) for k, v in sorted(data.arrays.items())
        )
        if self.structure is not None and layout == self._layout:
            return self.structure  # same shapes: keep the compiled rounds
        structure = vertical_structure(self.model, data.pooled())
        unknown = [p for p in structure.parties if p not in data.parties]
        if unknown or set(data.parties) - set(structure.parties):
            raise VerticalModelError(
                f"The model's parties {list(structure.parties)} differ from the "
                f"data's {list(data.parties)}."
            )
        if structure.kind == "power" and data.labels != "shared":
            raise ValueError(
                "The power likelihood (Algorithm 2) evaluates p(y | g_j, z_-j) at every "
                "party and so needs the labels there: it is refused with "
                "labels='server'. Use kind='augmented' (Algorithm 1), or "
                "VerticalData(..., labels='shared') if the parties may see y."
            )
        if structure.rows is not None and structure.rows[1] != data.num_rows:
            raise VerticalModelError(
                f"The rows plate {structure.rows[0]!r} has size {structure.rows[1]} but "
                f"the data have {data.num_rows} rows."
            )
        self.structure = structure
        self.family.setup(
            structure, {p: self.model.rho_of(p) for p in structure.parties}
        )
        self._optims_by_owner = self._optims()
        self.algorithm = vertical_sfvi(
            self.model, self.family, structure, self._optims_by_owner, stl=self.stl
        )
        self._built = {}
        self._layout = layout
        return structure

    def _views(self, data: VerticalData) -> dict:
        return {h: data.view(h) for h in self.structure.parties + (SERVER,)}

    def round_keys(self, rng_key: jax.Array) -> tuple[jax.Array, _Round]:
        """``(next key, this round's row indices and keys)``: the indices are shared
        by every party; each party's key is derived from its sorted position."""
        rng_key, k = jax.random.split(rng_key)
        rows = self.structure.rows
        idx = None
        if rows is not None and rows[2] < rows[1]:
            idx = jax.random.choice(
                jax.random.fold_in(k, 0), rows[1], (rows[2],), False
            )
        keys = {
            p: jax.random.fold_in(k, i + 1)
            for i, p in enumerate(self.structure.parties)
        }
        server_key = jax.random.fold_in(k, len(keys) + 1)
        return rng_key, _Round(idx, server_key, keys)

    def _round(self, state: VerticalSFVIState, views: dict, fns: VerticalAlgorithm):
        """One round with the functions ``fns`` (jitted or not)."""
        alg, parties = fns, self.structure.parties
        rng_key, r = self.round_keys(state.rng_key)
        ps = state.parties
        msgs = {
            p: alg.party_send(p, ps[p], views[p], r.party_keys[p], r.idx)
            for p in parties
        }
        self._log(state, "party", "server", msgs)
        broadcast = None
        if self.structure.kind == "augmented":
            server, grads, server_elbo = alg.server_step(
                state.server, msgs, views[SERVER], r.server_key, r.idx
            )
        else:
            broadcast = alg.server_broadcast(state.server, msgs, r.server_key)
            self._log(state, "server", "party", {p: broadcast for p in parties})
            cross = {
                p: alg.party_cross(
                    p, ps[p], views[p], r.party_keys[p], r.idx, broadcast
                )
                for p in parties
            }
            self._log(state, "party", "server", cross)
            server, grads, server_elbo = alg.server_collect(
                state.server, views[SERVER], r.server_key, r.idx, broadcast, cross
            )
        self._log(state, "server", "party", grads)
        new, elbos = {}, {}
        for p in parties:
            new[p], elbos[p] = alg.party_update(
                p, ps[p], views[p], r.party_keys[p], r.idx, grads[p], broadcast
            )
        loss = -(server_elbo + sum(elbos.values()))
        info = {SERVER: server_elbo, **elbos}
        return VerticalSFVIState(server, new, rng_key), loss, info

    def _log(self, state, sender, receiver, msgs):
        if self.record_messages and self.runtime == "sequential":
            for p, m in msgs.items():
                pair = (p, "server") if sender == "party" else ("server", p)
                self.messages.append((len(self.messages), *pair, m))

    def _step_fn(self, views: dict):
        """``state -> (state, loss, info)`` for the runtime."""
        if self.runtime == "simulate":
            if "simulate" not in self._built:
                self._built["simulate"] = jax.jit(
                    lambda s, v: self._round(s, v, self.algorithm)
                )
            jitted = self._built["simulate"]
            return lambda s: jitted(s, views)
        if "sequential" not in self._built:
            alg = self.algorithm
            self._built["sequential"] = VerticalAlgorithm(
                *(jax.jit(f, static_argnums=0) for f in (alg.party_send,)),
                jax.jit(alg.server_step),
                jax.jit(alg.server_broadcast),
                jax.jit(alg.party_cross, static_argnums=0),
                jax.jit(alg.server_collect),
                jax.jit(alg.party_update, static_argnums=0),
            )
        fns = self._built["sequential"]
        return lambda s: self._round(s, views, fns)

    # -------------------------------------------------------------- NumPyro API
    def init(self, rng_key: jax.Array, data: VerticalData) -> VerticalSFVIState:
        """
        Trace the model, initialize every owner's parameters and optimizer, and check
        that one round is finite for every owner on its own view of the data (a term
        that reads columns its owner does not hold is NaN: the error names it).

        :param jax.random.key rng_key: random key.
        :param VerticalData data: the parties' and the server's arrays.
        :return: the initial state.
        """
        self.setup(data)
        views = self._views(data)
        rng_key, init_key = jax.random.split(rng_key)
        parties = {}
        for i, p in enumerate(self.structure.parties):
            key = jax.random.fold_in(init_key, i + 1)
            raw = self.family.init(p, key)
            if self.family.aux == "meanfield":  # start q(z_j) at the prior mean
                # jitted: placeholders (NaN) in other parties' blocks must not meet
                # NumPyro's eager argument validation
                u = jax.jit(partial(self._contribution_at, p))(raw, views[p])
                raw = self.family.init(p, key, u)
            parties[p] = VerticalPartyState(raw, self._optims_by_owner[p].init(raw))
        raw0 = self.family.init(SERVER, init_key)
        server = VerticalServerState(raw0, self._optims_by_owner[SERVER].init(raw0))
        state = VerticalSFVIState(server, parties, rng_key)
        step = self._step_fn(views)
        # strong dtypes as a round returns them, so that rounds compile once
        shapes = jax.eval_shape(step, state)[0]
        state = jax.tree.map(
            lambda x, y: jax.lax.convert_element_type(x, y.dtype), state, shapes
        )
        _, _, info = step(state)
        bad = [o for o, v in info.items() if not np.isfinite(float(v))]
        if bad:
            raise VerticalModelError(
                f"The ELBO term of {bad} is not finite on its owner's own view of the "
                "data at initialization: it reads arrays, latents or contributions its "
                "owner does not hold (or the model is invalid at the prior's center)."
            )
        self.messages = []
        return state

    def _contribution_at(self, party, raw, view):
        p = self.family.constrain(party, raw)
        values = {}
        if "loc" in p:
            values, _ = self.family.unpack(party, p["loc"])
        values.update(p["param"])
        rows = self.structure.rows
        if rows is not None and rows[2] < rows[1]:
            # the full-data contribution: the plate's indices set to every row
            values[rows[0]] = jnp.arange(rows[1])
        seeded = handlers.seed(
            handlers.substitute(
                self.model.run, data=fill_values(self.structure, values)
            ),
            jax.random.key(0),
        )
        return seeded("probe", **view)[1].contributions[party]

    def update(
        self, state: VerticalSFVIState, data: VerticalData
    ) -> tuple[VerticalSFVIState, jax.Array]:
        """One round; returns ``(state, loss)``, the loss (negative ELBO estimate)
        at the pre-update parameters."""
        if self.structure is None:
            raise RuntimeError("Call init(key, data) before update.")
        state, loss, _ = self._step_fn(self._views(data))(state)
        return state, loss

    def run(
        self,
        rng_key: jax.Array,
        num_steps: int,
        data: VerticalData,
        *,
        progress_bar: bool = True,
        init_state: VerticalSFVIState | None = None,
    ) -> RunResult:
        """
        Run ``num_steps`` rounds.

        :param jax.random.key rng_key: random key (ignored with ``init_state``).
        :param int num_steps: number of rounds.
        :param VerticalData data: the data.
        :param bool progress_bar: show a tqdm bar (otherwise one ``lax.scan`` in
            simulation).
        :param VerticalSFVIState init_state: resume from this state.
        :return: ``RunResult(params, state, losses)``.
        """
        state = init_state if init_state is not None else self.init(rng_key, data)
        step = self._step_fn(self._views(data))
        state, losses = run_loop(
            lambda s: step(s)[:2],
            state,
            num_steps,
            progress_bar=progress_bar,
            # a scan compiles the round again: worth it for long runs only
            scan=self.runtime == "simulate" and num_steps >= 200,
        )
        return RunResult(self.get_params(state), state, losses)

    def get_params(self, state: VerticalSFVIState) -> VerticalParams:
        """The constrained parameters of ``state``, by owner."""
        fam = self.family
        return VerticalParams(
            fam.constrain(SERVER, state.server.raw),
            {p: fam.constrain(p, s.raw) for p, s in state.parties.items()},
        )

    def sample_posterior(
        self, rng_key: jax.Array, params: VerticalParams, *, num_samples: int = 1
    ) -> dict:
        """
        Draws of every party's and the server's latent sites from the fitted
        :math:`q(\\gamma)\\prod_j q(\\theta_j)` (the auxiliaries are left out: their
        posterior is not identified, only their sum is).

        :param jax.random.key rng_key: random key.
        :param VerticalParams params: fitted parameters (``result.params``).
        :param int num_samples: number of draws.
        :return: dict site name -> draws with a leading ``num_samples`` axis.
        """
        owners = {SERVER: params.server, **params.parties}

        def one(key):
            out = {}
            for i, (owner, p) in enumerate(sorted(owners.items())):
                if "loc" not in p:
                    continue
                eps = jax.random.normal(jax.random.fold_in(key, i), p["loc"].shape)
                out.update(self.family.unpack(owner, self.family.draw_flat(p, eps))[0])
            return out

        return jax.vmap(one)(jax.random.split(rng_key, num_samples))

    # ---------------------------------------------------------- equivalences
    def joint_elbo(
        self, raws: dict, rng_key: jax.Array, data: VerticalData
    ) -> jax.Array:
        """
        The single-sample ELBO of the round drawn from ``rng_key`` (same noise and
        rows as :meth:`update`), computed jointly on pooled data with NumPyro's
        ``log_density`` of the whole augmented model: the reference that the message
        protocol's gradients must reproduce.

        :param dict raws: owner -> raw parameters (``state.parties[p].raw``, and
            ``state.server.raw`` under ``"server"``).
        """
        fam, st = self.family, self.structure
        _, r = self.round_keys(rng_key)
        arrays = data.pooled()
        alg_noise = {}
        values, log_q = {}, jnp.zeros(())
        for owner in st.parties + (SERVER,):
            p = fam.constrain(owner, raws[owner])
            p_q = _sg(p) if self.stl else p
            key = r.server_key if owner == SERVER else r.party_keys[owner]
            k1, k2 = jax.random.split(key)
            eps = jax.random.normal(k1, (fam.dim(owner),))
            draw, lq = fam.draw_latents(owner, p, p_q, eps)
            values.update(draw)
            values.update(p["param"])
            log_q = log_q + lq
            alg_noise[owner] = (p, p_q, k2)
        rows = st.rows
        if rows is not None and rows[2] < rows[1]:
            values[rows[0]] = r.idx
        seeded = handlers.seed(
            handlers.substitute(self.model.run, data=fill_values(st, values)),
            jax.random.key(0),
        )
        _, h = seeded("probe", **arrays)
        y = None
        if fam.aux == "amortized" and st.kind == "power":
            y = next(iter(h.likelihood.values()))["value"]
        for party in st.parties:
            p, p_q, k2 = alg_noise[party]
            tau = jax.random.normal(k2, st.z_shape[party])
            u = h.contributions[party]
            zd = fam.z_dist(party, p, u, y, r.idx)
            z = zd.loc + zd.scale * tau
            log_q = (
                log_q
                + st.z_scale * fam.z_dist(party, p_q, u, y, r.idx).log_prob(z).sum()
            )
            values[z_name(party)] = z
        model_params = {k: v for k, v in values.items() if k in _param_names(st)}
        latent = {k: v for k, v in values.items() if k not in model_params}
        log_joint, _ = log_density(
            handlers.substitute(self.model, data=model_params), (), arrays, latent
        )
        return log_joint - log_q

    def numpyro_guide(self, init_raws: dict) -> Callable:
        """
        The family as an ordinary NumPyro guide of the augmented model (full-batch
        only), for centralized ``SVI`` or ``Trace_ELBO`` on pooled data. Its
        ``numpyro.param`` sites are named ``"_vfl/{owner}/{leaf}"``; the model's
        own ``numpyro.param`` sites stay in the model.

        :param dict init_raws: owner -> raw parameters to start from.
        """
        fam, st, model = self.family, self.structure, self.model
        rows = st.rows
        if rows is not None and rows[2] < rows[1]:
            raise NotImplementedError(
                "numpyro_guide() is full-batch; the rows plate is subsampled."
            )
        owners = st.parties + (SERVER,)

        def guide(**arrays):
            values, raws = {}, {}
            for owner in owners:
                leaves, tree = jax.tree_util.tree_flatten_with_path(init_raws[owner])
                new = []
                for path, leaf in leaves:
                    if _path_str(path).startswith("param"):
                        new.append(leaf)  # model params are the model's own sites
                        continue
                    new.append(numpyro.param(f"_vfl/{owner}/{_path_str(path)}", leaf))
                raws[owner] = jax.tree_util.tree_unflatten(tree, new)
                p = fam.constrain(owner, raws[owner])
                values.update(p["param"])
                if "loc" not in p:
                    continue
                flat = numpyro.sample(
                    f"_vfl/{owner}/latent",
                    fam.theta_dist(p),
                    infer={"is_auxiliary": True},
                )
                start = 0
                for name, spec in sorted(st.latents[owner].items()):
                    size = int(np.prod(spec.unconstrained_shape))
                    x = flat[start : start + size].reshape(spec.unconstrained_shape)
                    start += size
                    t = biject_to(spec.support)
                    v = t(x)
                    log_det = jnp.sum(t.log_abs_det_jacobian(x, v))
                    values[name] = numpyro.sample(
                        name,
                        dist.Delta(v, log_density=-log_det, event_dim=len(spec.shape)),
                    )
            probe = handlers.block(
                handlers.seed(
                    handlers.substitute(model.run, data=fill_values(st, values)),
                    jax.random.key(0),
                )
            )
            _, h = probe("probe", **arrays)
            y = None
            if fam.aux == "amortized" and st.kind == "power":
                y = next(iter(h.likelihood.values()))["value"]
            for party in st.parties:
                p = fam.constrain(party, raws[party])
                zd = fam.z_dist(party, p, h.contributions[party], y)
                numpyro.sample(z_name(party), zd.to_event(st.z_event_dim[party]))

        return guide


def _param_names(structure: VerticalStructure) -> set:
    return {n for owner in structure.params.values() for n in owner}


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
