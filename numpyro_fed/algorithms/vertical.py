# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Vertical federated VI (Hassan et al. seed 003, Algorithms 1 and 2):
:class:`VerticalSFVI`, NumPyro's ``SVI`` API over the pure protocol of
:mod:`numpyro_fed.algorithms.vertical_protocol`.

Two runtimes drive the protocol's functions: ``"simulate"`` (one jitted round;
parties whose blocks are equal up to names run as one vmapped call, the others one
after another inside the round) and ``"sequential"`` (each party's step jitted on its
own and called in turn, with every message materialized and optionally recorded).
"""

from functools import partial
from typing import Any, Callable, NamedTuple
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers
import optax

from numpyro_fed.algorithms import vertical_reference
from numpyro_fed.algorithms._runner import RunResult, run_loop
from numpyro_fed.algorithms.vertical_parties import (
    PartyGroup,
    checked,
    drive_round,
    find_groups,
    row_errors,
    signature,
)
from numpyro_fed.algorithms.vertical_protocol import (
    AuxBroadcast,
    AuxGrad,
    AuxSample,
    CrossGrads,
    RowIndexMismatchError,
    VerticalAlgorithm,
    VerticalParams,
    VerticalPartyState,
    VerticalServerState,
    VerticalSFVIState,
    vertical_sfvi,
)
from numpyro_fed.vertical.augment import AugmentedModel, VerticalModelError
from numpyro_fed.vertical.data import VerticalData
from numpyro_fed.vertical.families import VerticalFamily
from numpyro_fed.vertical.structure import (
    SERVER,
    VerticalStructure,
    fill_values,
    likelihood_dependencies,
    vertical_structure,
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
    "VerticalSFVI",
    "VerticalSFVIState",
    "VerticalServerState",
    "vertical_sfvi",
]


def name_key_data(name: str) -> int:
    """The ``fold_in`` datum of an owner's key: a CRC-32 of its name, so that a
    party's noise depends on its name only (not on its position, nor on the other
    parties' names). Python's ``hash`` is salted per process and cannot be used."""
    return zlib.crc32(name.encode())


class _Round(NamedTuple):
    """- **idx** - the server's row indices (``None``: every row).
    - **server_key** - the server's key.
    - **party_keys** - party -> its key.
    - **party_idx** - party -> the row indices it uses (derived from the same round
      key: equal to ``idx`` unless a party deviates, which the server detects)."""

    idx: Any
    server_key: jax.Array
    party_keys: dict
    party_idx: dict


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
    :param int local_steps: optimizer steps each party takes per round with the
        server's gradient and the round's noise held fixed. ``1`` (default) is
        Algorithm 1/2 and gives unbiased gradients; more steps ascend the server
        term's *linearization* :math:`\\langle g_j, z_j\\rangle` around the
        round's :math:`z_j`, which is exact only for the first step: an
        approximation (the split-NN style of local work), warned about once.
    :param bool vmap_parties: in the simulation runtime, run the parties whose blocks
        are equal up to names (same shapes, same optimizer and :math:`\\rho`, and the
        same values at a random probe point) as one vmapped call; the others, and
        every party under ``vmap_parties=False``, run one after another in the round.
        The two paths agree to rounding error.

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
        local_steps: int = 1,
        vmap_parties: bool = True,
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
        if not isinstance(local_steps, int) or isinstance(local_steps, bool):
            raise TypeError(f"local_steps must be an int, got {local_steps!r}.")
        if local_steps < 1:
            raise ValueError(f"local_steps must be >= 1, got {local_steps}.")
        if local_steps > 1:
            warnings.warn(
                f"VerticalSFVI(local_steps={local_steps}): the extra local steps ascend "
                "the linearization <g_j, z_j> of the server's term around the round's "
                "z_j with a stale server gradient; only the first step follows the "
                "ELBO's gradient, so the fit is approximate.",
                UserWarning,
                stacklevel=2,
            )
        self.local_steps = local_steps
        self.vmap_parties = bool(vmap_parties)
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
        self._groups: tuple[PartyGroup, ...] | None = None
        self._held: dict = {}

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
        # A likelihood that reads a party other than through its auxiliary would
        # make the server's term depend on that party's latents: refuse it here
        # rather than run a protocol that silently drops those gradients.
        likelihood_dependencies(self.model, data.pooled())
        self.structure = structure
        self.family.setup(
            structure, {p: self.model.rho_of(p) for p in structure.parties}
        )
        self._optims_by_owner = self._optims()
        self.algorithm = vertical_sfvi(
            self.model,
            self.family,
            structure,
            self._optims_by_owner,
            stl=self.stl,
            local_steps=self.local_steps,
        )
        data_keys = [name_key_data(o) for o in structure.parties + (SERVER,)]
        if len(set(data_keys)) < len(data_keys) or 0 in data_keys:
            raise ValueError(
                f"The parties' names {list(structure.parties)} give colliding keys "
                "(CRC-32); rename one."
            )
        self._held = {
            p: tuple(sorted(k for k, o in data.owner.items() if o == p))
            for p in structure.parties
        }
        self._built = {}
        self._groups = None
        self._layout = layout
        return structure

    def _views(self, data: VerticalData) -> dict:
        return {h: data.view(h) for h in self.structure.parties + (SERVER,)}

    def round_keys(self, rng_key: jax.Array) -> tuple[jax.Array, _Round]:
        """``(next key, this round's row indices and keys)``: every owner derives the
        row indices from the shared round key (so all use the same rows); each
        owner's key is derived from its *name* (:func:`name_key_data`)."""
        rng_key, k = jax.random.split(rng_key)
        rows = self.structure.rows
        idx = None
        if rows is not None and rows[2] < rows[1]:
            idx = jax.random.choice(
                jax.random.fold_in(k, 0), rows[1], (rows[2],), False
            )
        parties = self.structure.parties
        keys = {p: jax.random.fold_in(k, name_key_data(p)) for p in parties}
        server_key = jax.random.fold_in(k, name_key_data(SERVER))
        return rng_key, _Round(idx, server_key, keys, {p: idx for p in parties})

    def _round(
        self,
        state: VerticalSFVIState,
        views: dict,
        fns: VerticalAlgorithm,
        groups: tuple[PartyGroup, ...] | None = None,
    ):
        """One round with the functions ``fns`` (jitted or not); the parties of each
        group of ``groups`` run as one vmapped call (default: one by one)."""
        rng_key, r = self.round_keys(state.rng_key)
        server, parties, loss, info = drive_round(
            fns,
            self.structure,
            state.server,
            state.parties,
            views,
            r,
            groups,
            lambda sender, msgs: self._log(state, sender, None, msgs),
        )
        return VerticalSFVIState(server, parties, rng_key), loss, info

    def _log(self, state, sender, receiver, msgs):
        if self.record_messages and self.runtime == "sequential":
            for p, m in msgs.items():
                pair = (p, "server") if sender == "party" else ("server", p)
                self.messages.append((len(self.messages), *pair, m))

    def _find_groups(self, state: VerticalSFVIState, views: dict) -> None:
        """Group the parties for the simulation runtime (see ``vmap_parties``)."""
        parties = self.structure.parties
        if not (self.vmap_parties and self.runtime == "simulate" and len(parties) > 1):
            self._groups = None
            return
        sigs = {
            p: signature(
                state.parties[p].raw,
                state.parties[p].opt_state,
                [views[p][a] for a in self._held[p]],
                (
                    id(self._optims_by_owner[p]),
                    float(self.model.rho_of(p)),
                    self.structure.z_shape[p],
                    self.structure.z_event_dim[p],
                ),
            )
            for p in parties
        }
        if len(set(sigs.values())) == len(parties):
            self._groups = None  # nothing to group: skip the probe
            return
        _, r = self.round_keys(state.rng_key)
        self._groups = find_groups(
            self.algorithm.party_elbo,
            parties,
            sigs,
            self._held,
            views,
            {p: s.raw for p, s in state.parties.items()},
            jax.random.fold_in(state.rng_key, 7),
            r.idx,
        )
        if all(len(g.parties) == 1 for g in self._groups):
            self._groups = None
        self._built.pop("simulate", None)

    @property
    def party_groups(self) -> tuple[tuple[str, ...], ...]:
        """The parties the simulation runtime runs together (one vmapped call per
        group of two or more; the rest one by one), set by :meth:`init`."""
        if self._groups is None:
            return tuple((p,) for p in self.structure.parties)
        return tuple(g.parties for g in self._groups)

    def _step_fn(self, views: dict):
        """``state -> (state, loss, info)`` for the runtime."""
        if self.runtime == "simulate":
            if "simulate" not in self._built:
                self._built["simulate"] = jax.jit(
                    partial(_round_of, self, groups=self._groups)
                )
            jitted = self._built["simulate"]
            return checked(lambda s: jitted(s, views))
        if "sequential" not in self._built:
            alg = self.algorithm
            self._built["sequential"] = VerticalAlgorithm(
                jax.jit(alg.party_send, static_argnums=0),
                jax.jit(alg.server_step),
                jax.jit(alg.server_broadcast),
                jax.jit(alg.party_cross, static_argnums=0),
                jax.jit(alg.server_collect),
                jax.jit(alg.party_update, static_argnums=0),
                jax.jit(alg.party_elbo, static_argnums=0),
            )
        fns = self._built["sequential"]
        return checked(lambda s: self._round(s, views, fns))

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
        self._find_groups(state, views)
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
        views = self._views(data)
        if init_state is not None and "simulate" not in self._built:
            self._find_groups(state, views)
        step = self._step_fn(views)
        with row_errors():
            state, losses = run_loop(
                lambda s: step(s)[:2],
                state,
                num_steps,
                progress_bar=progress_bar,
                # a scan compiles the round again: worth it for long runs only
                scan=self.runtime == "simulate" and num_steps >= 200,
            )
            jax.block_until_ready(losses)
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
        :param jax.random.key rng_key: the round's key (``state.rng_key``).
        :param VerticalData data: the data.
        """
        return vertical_reference.joint_elbo(self, raws, rng_key, data)

    def numpyro_guide(self, init_raws: dict) -> Callable:
        """
        The family as an ordinary NumPyro guide of the augmented model (full-batch
        only), for centralized ``SVI`` or ``Trace_ELBO`` on pooled data. Its
        ``numpyro.param`` sites are named ``"_vfl/{owner}/{leaf}"``; the model's
        own ``numpyro.param`` sites stay in the model.

        :param dict init_raws: owner -> raw parameters to start from.
        """
        return vertical_reference.numpyro_guide(self, init_raws)


def _round_of(vfl: VerticalSFVI, state, views, groups=None):
    return vfl._round(state, views, vfl.algorithm, groups)
