# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""``VerticalSFVI``: NumPyro's ``SVI`` API over
:func:`~numpyro_fed.algorithms.vertical_sfvi.vertical_sfvi` on the one driver.

The parties are silos whose states differ in structure, so the round runs under the
grouped runtime (:func:`~numpyro_fed.runtime.groups.group_round`): parties whose
blocks are equal up to names (:func:`~numpyro_fed.vertical.parties.find_groups`)
are stacked and vmapped as one group, the others are groups of one.
"""

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from numpyro_fed.algorithms import vertical_reference
from numpyro_fed.algorithms.vertical_sfvi import (
    check_local_steps,
    name_key_data,
    num_phases,
    recording,
    row_errors,
    vertical_sfvi,
)
from numpyro_fed.checks import check_state_layout
from numpyro_fed.infer.driver import Driver, FederatedState, RunResult
from numpyro_fed.protocol import SiloData, jit_algorithm
from numpyro_fed.runtime import sharded_group_round, silo_mesh
from numpyro_fed.runtime.groups import group_round, stack_groups, unstack_groups
from numpyro_fed.util import tree_where
from numpyro_fed.vertical.augment import AugmentedModel, VerticalModelError
from numpyro_fed.vertical.data import VerticalData
from numpyro_fed.vertical.families import VerticalFamily
from numpyro_fed.vertical.parties import (
    PartyGroup,
    find_groups,
    groups_from_slots,
    lay_out,
    own_layouts,
    rename,
    signature as party_signature,
)
from numpyro_fed.vertical.structure import (
    SERVER,
    VerticalStructure,
    likelihood_dependencies,
    vertical_structure,
)
from numpyro_fed.vertical.terms import vertical_terms

__all__ = ["RoundKeys", "VerticalParams", "VerticalSFVI"]


class VerticalParams(NamedTuple):
    """Constrained parameters by owner (see :meth:`VerticalFamily.constrain`).

    - **server** - ``loc``, ``scale_tril``/``scale`` of :math:`q(\\gamma)`, ``param``.
    - **parties** - party -> ``loc``, ``scale_tril``/``scale``, ``z_loc``/``z_scale``
      or ``net``, ``param``.
    """

    server: dict
    parties: dict


class RoundKeys(NamedTuple):
    """- **idx** - the round's row indices (``None``: every row).
    - **server_key** - the server's noise key.
    - **party_keys** - party -> its key."""

    idx: Any
    server_key: jax.Array
    party_keys: dict


class VerticalSFVI(Driver):
    """
    Vertical federated VI on an augmented model (Hassan et al. seed 003,
    Algorithm 1 for ``kind="augmented"``, Algorithm 2 for ``kind="power"``), with the
    API of NumPyro's ``SVI``: ``init / update / run / get_params /
    sample_posterior``. One round (``update``) is one iteration of the algorithm:
    its phases (:func:`~numpyro_fed.algorithms.vertical_sfvi.num_phases`) run in
    order.

    Messages of Algorithm 1 carry only :math:`z_j`, its ELBO term and
    :math:`\\partial\\mathcal L_0/\\partial z_j` (one number per row and party per
    round, and a scalar); :math:`x_j`, :math:`\\theta_j` and :math:`x_j\\theta_j` never
    leave party :math:`j`. :math:`z_j` is itself a noisy per-row projection of
    :math:`x_j`, and the server's gradient is a function of the labels: see
    ``docs/vertical-fl.md``.

    :param AugmentedModel model: ``nf.augment(model, rho, kind)``.
    :param VerticalFamily family: the variational family.
    :param optim: an optax optimizer for every owner, or a dict owner (each party and
        ``"server"``) -> optimizer: each party updates with its own.
    :param bool stl: sticking-the-landing gradients.
    :param str runtime: ``"simulate"`` (one jitted round), ``"sequential"`` (one
        party at a time, each function jitted on its own, messages materialized) or
        ``"sharded"`` (one jitted round, the party groups spread over all local
        devices: :func:`~numpyro_fed.runtime.sharded_group_round`).
    :param bool record_messages: with the sequential runtime, keep every message in
        ``self.messages`` as ``(index, sender, receiver, message)``.
    :param int local_steps: optimizer steps each party takes per round with the
        server's gradient and the round's noise held fixed. ``1`` (default) is
        Algorithm 1/2 and gives unbiased gradients; more steps ascend the server
        term's *linearization* :math:`\\langle g_j, z_j\\rangle` around the
        round's :math:`z_j`, which is exact only for the first step: an
        approximation (the split-NN style of local work), warned about once.
    :param bool vmap_parties: in the simulation and sharded runtimes, run the parties whose blocks
        are equal up to names (same shapes, same optimizer and :math:`\\rho`, and the
        same values at a random probe point) as one vmapped call; the others, and
        every party under ``vmap_parties=False``, one after another in the round.
        The two paths agree to rounding error.
    :param float max_rejected: stop when a party's replies were rejected in more
        than this fraction of the rounds (see
        :class:`~numpyro_fed.infer.driver.Driver`).

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

    min_scan_steps = 200

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
        max_rejected: float | None = 0.25,
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
        if runtime not in ("simulate", "sequential", "sharded"):
            raise ValueError(
                "VerticalSFVI: runtime must be 'simulate', 'sequential' or 'sharded', "
                f"got {runtime!r}."
            )
        if not isinstance(optim, (dict, optax.GradientTransformation)):
            raise TypeError(
                "optim must be an optax.GradientTransformation or a dict owner -> "
                f"optimizer; got {type(optim).__name__}."
            )
        local_steps = check_local_steps(local_steps)
        super().__init__(runtime=runtime, max_rejected=max_rejected)
        self.model = model
        self.family = family
        self.optim = optim
        self.stl = stl
        self.local_steps = local_steps
        self.vmap_parties = bool(vmap_parties)
        self.record_messages = record_messages
        self.messages: list = []
        self.structure: VerticalStructure | None = None
        self._shapes: tuple = ()
        self._groups: tuple[PartyGroup, ...] | None = None
        self._trees: dict = {}
        self._held: dict = {}

    @property
    def _bound(self) -> VerticalStructure:
        """The structure :meth:`setup` bound (an error before it)."""
        if self.structure is None:
            raise RuntimeError(
                "VerticalSFVI has no model structure yet: call setup first."
            )
        return self.structure

    # ------------------------------------------------------------ construction
    def _optims(self) -> dict:
        owners = self._bound.parties + (SERVER,)
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

    @staticmethod
    def _layout(data: Any) -> tuple:
        return (data.labels, data.parties) + tuple(
            (k, v.shape, str(v.dtype)) for k, v in sorted(data.arrays.items())
        )

    def setup(self, data: VerticalData) -> VerticalStructure:
        """Trace the model on ``data`` and bind the family (done by :meth:`init`)."""
        if not isinstance(data, VerticalData):
            raise TypeError(
                f"data must be a nf.VerticalData, got {type(data).__name__}."
            )
        layout = self._layout(data)
        if self.structure is not None and layout == self._shapes:
            return self.structure  # same shapes: keep the compiled rounds
        structure = vertical_structure(self.model, data.pooled())
        if set(structure.parties) != set(data.parties):
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
        # A likelihood that reads a party other than through its auxiliary makes the
        # server's term depend on that party's latents: refuse it, not drop gradients.
        likelihood_dependencies(self.model, data.pooled())
        self.structure = structure
        rhos = {p: self.model.rho_of(p) for p in structure.parties}
        self.family.setup(structure, rhos)
        self.exchanges = num_phases(structure.kind)  # the phases share a round's keys
        self._optims_by_owner = self._optims()
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
        self._shapes = layout
        return structure

    def _make_algorithm(self, data: VerticalData):
        return vertical_sfvi(
            self.model,
            self.family,
            self._bound,
            self._optims_by_owner,
            data.view(SERVER),
            stl=self.stl,
            local_steps=self.local_steps,
        )

    def _build(self, data: VerticalData):
        """The algorithm (it holds the server's view of ``data``) and the round
        function for the current party groups (cached for this data object)."""
        self.setup(data)
        key = (id(data), self.runtime, self._groups)
        entry = self._built.get("round")
        if entry is None or entry[0] != key or entry[1] is not data:
            with jax.ensure_compile_time_eval():  # may be built inside a trace
                algorithm = self._make_algorithm(data)
            round_fn = self._round_fn(algorithm, self._silo_groups())
            entry = (key, data, algorithm, round_fn)
            self._built["round"] = entry
        return entry[2], entry[3]

    def _run_key(self, data: VerticalData) -> Any:
        # the algorithm holds the server's view of these data: one loop per object
        return (id(data), self._groups)

    def _silo_groups(self) -> tuple:
        parties = self._bound.parties
        return tuple(tuple(parties.index(p) for p in g) for g in self.party_groups)

    def _round_fn(self, algorithm, groups: tuple) -> Callable:
        phases = num_phases(self._bound.kind)
        if self.runtime == "sequential":
            algorithm = jit_algorithm(algorithm)
            if self.record_messages:
                algorithm = recording(algorithm, self._bound.kind, self.messages)
        step = partial(group_round, algorithm)
        if self.runtime == "sharded":
            step = partial(sharded_group_round, algorithm, silo_mesh())

        def round_fn(server, silos, data, server_key, silo_keys, participating):
            keys = tuple(silo_keys[np.asarray(g)] for g in groups)
            before = (server, silos)
            infos = []
            for phase in range(phases):
                # a constant (not traced) phase: each call compiles its branch only
                server = server._replace(phase=np.int32(phase))
                server, silos, info = step(
                    groups, server, silos, data, server_key, keys, participating
                )
                infos.append(info)
            # A party's rejected reply in any phase voids the whole iteration, so no
            # party steps on gradients computed from another's non-finite values.
            rejected = jnp.any(jnp.stack([i.rejected for i in infos]), axis=0)
            server, silos = tree_where(~jnp.any(rejected), (server, silos), before)
            info = infos[phases - 2]  # the phase with the loss
            return server, silos, info._replace(rejected=rejected)

        return round_fn if self.runtime == "sequential" else jax.jit(round_fn)

    # ------------------------------------------------------------------ layout
    @property
    def party_groups(self) -> tuple[tuple[str, ...], ...]:
        """The parties the round runs together (one vmapped call per group of two or
        more; the rest one by one), set when a state is laid out (:meth:`init`)."""
        if self._groups is None:
            return tuple((p,) for p in self._bound.parties)
        return tuple(g.parties for g in self._groups)

    def _renames(self, party: str) -> tuple[str, dict, dict]:
        """``(lead, party renaming, array renaming)`` of ``party``'s group."""
        for g in self._groups or ():
            if party in g.parties:
                return (g.lead, *g.renames[party])
        return party, {}, {}

    def _party_data(self, data: VerticalData, party: str, own: Any = 0) -> SiloData:
        lead, _, arrays = (party, {}, {}) if own else self._renames(party)  # own names
        n = data.num_rows
        view = rename(data.view(party), arrays)
        return SiloData({lead: view}, jnp.ones((n,), bool), jnp.arange(n))

    def _silo_data(self, data: VerticalData) -> tuple:
        key = (id(data), self._groups)
        cached = self._built.get("data")
        if cached is None or cached[0] != key or cached[1] is not data:
            with jax.ensure_compile_time_eval():  # may be asked inside a trace
                silos = [self._party_data(data, p) for p in self._bound.parties]
                cached = (key, data, stack_groups(silos, self._silo_groups()))
            self._built["data"] = cached
        return cached[2]

    def _silo_spec(self, data: VerticalData) -> tuple:
        own = [self._party_data(data, p, 1) for p in self._bound.parties]
        return tuple(jax.eval_shape(lambda: own))  # a deployed party: its own names

    def _round_keys(self, rng_key: jax.Array, num_silos: int):
        rng_key, k = jax.random.split(rng_key)
        parties = self._bound.parties
        keys = jnp.stack([jax.random.fold_in(k, name_key_data(p)) for p in parties])
        return rng_key, k, keys

    def round_keys(self, rng_key: jax.Array) -> tuple[jax.Array, RoundKeys]:
        """``(next key, this round's rows and keys)``, as the round derives them: the
        rows and every owner's key come from the round key, each owner's from its
        *name* (:func:`~numpyro_fed.algorithms.vertical_sfvi.name_key_data`)."""
        rng_key, k, keys = self._round_keys(rng_key, len(self._bound.parties))
        rows = self._bound.rows
        idx = None
        if rows is not None and rows[2] < rows[1]:
            idx = jax.random.choice(jax.random.fold_in(k, 0), rows[1], rows[2:], False)
        server_key = jax.random.fold_in(k, name_key_data(SERVER))
        party_keys = dict(zip(self._bound.parties, keys, strict=True))
        return rng_key, RoundKeys(idx, server_key, party_keys)

    def _find_groups(self, parties: dict, data: VerticalData, rng_key) -> None:
        """Group the parties (``vmap_parties``) unless the runtime is sequential."""
        names = self._bound.parties
        self._groups = None
        if not (self.vmap_parties and self.runtime != "sequential" and len(names) > 1):
            return
        views = {p: data.view(p) for p in names}
        sigs = {
            p: party_signature(
                parties[p].raw,
                parties[p].opt_state,
                [views[p][a] for a in self._held[p]],
                (
                    id(self._optims_by_owner[p]),
                    float(self.model.rho_of(p)),
                    self._bound.z_shape[p],
                    self._bound.z_event_dim[p],
                ),
            )
            for p in names
        }
        if len(set(sigs.values())) == len(names):
            return  # nothing to group: skip the probe
        terms = vertical_terms(self.model, self.family, self._bound, {})
        groups = find_groups(
            terms.party_elbo,
            names,
            sigs,
            self._held,
            views,
            {p: s.raw for p, s in parties.items()},
            jax.random.fold_in(rng_key, 7),
            self.round_keys(rng_key)[1].idx,
        )
        if any(len(g.parties) > 1 for g in groups):
            self._groups = groups

    def state_of(
        self, server: Any, parties: dict, rng_key: jax.Array, data: VerticalData
    ) -> FederatedState:
        """The :class:`~numpyro_fed.infer.driver.FederatedState` of a server state and
        party -> :class:`~numpyro_fed.algorithms.vertical_sfvi.VerticalPartyState`
        (each in its own layout), the parties laid out in groups (found here)."""
        self.setup(data)
        self._find_groups(parties, data, rng_key)
        self._trees = {p: jax.tree.structure(s) for p, s in parties.items()}
        return self._laid(server, parties, rng_key)

    def _laid(self, server: Any, parties: dict, rng_key: jax.Array) -> FederatedState:
        """The state of ``parties`` (each in its own layout) in the current groups."""
        laid = lay_out(self._bound.parties, self._groups, parties)
        return FederatedState(server, stack_groups(laid, self._silo_groups()), rng_key)

    def party_states(self, state: FederatedState) -> dict:
        """Party -> its party state in its own layout (as :meth:`state_of` takes)."""
        laid = unstack_groups(state.silos, self._silo_groups())
        return own_layouts(self._bound.parties, laid, self._trees)

    def _own_states(self, key: jax.Array, data: VerticalData) -> tuple[Any, dict]:
        """``(server, party -> state)`` of :meth:`init`, each in its own layout."""
        algorithm = self._make_algorithm(data)
        # jitted: placeholders (NaN) in other parties' blocks must not meet
        # NumPyro's eager argument validation
        init_silo = jax.jit(algorithm.init_silo)
        parties = {  # each under its own names, not its group's
            p: init_silo(jax.random.fold_in(key, i + 1), self._party_data(data, p, 1))
            for i, p in enumerate(self._bound.parties)
        }
        return jax.jit(algorithm.init_server)(key), parties

    def _check(self, state: FederatedState, data: Any) -> None:
        """Raise unless ``state`` fits ``data``; a state laid out elsewhere (a
        fresh object resuming it) brings its party groups, read from its slots."""
        self.setup(data)
        fix = "start from VerticalSFVI.init(key, data) on these data"
        silos = state.silos if isinstance(state, FederatedState) else None
        groups = groups_from_slots(self._bound.parties, silos, self._held)
        if groups is None:
            raise ValueError(
                "VerticalSFVI: the state is not a run's state (result.state) over "
                f"this data's parties {list(data.parties)}; {fix}."
            )
        key = (groups, state.rng_key.dtype)
        if self._built.get("state", (None,))[0] != key:
            own = jax.eval_shape(lambda k: self._own_states(k, data), state.rng_key)
            self._trees = {p: jax.tree.structure(s) for p, s in own[1].items()}
            self._groups = groups if any(len(g.parties) > 1 for g in groups) else None
            laid = jax.eval_shape(self._laid, *own, state.rng_key)
            self._built["state"] = (key, laid)
        check_state_layout(
            "VerticalSFVI", state, self._built["state"][1], fix, dtypes=False
        )

    # -------------------------------------------------------------- NumPyro API
    def init(
        self, rng_key: jax.Array, data: VerticalData, *, init_params: Any = None
    ) -> FederatedState:
        """
        Trace the model, initialize every owner's parameters and optimizer, and check
        that one round is finite for every owner on its own view of the data (a term
        that reads columns its owner does not hold is NaN: the error names it).

        :param jax.random.key rng_key: random key.
        :param VerticalData data: the parties' and the server's arrays.
        :return: the initial state.
        """
        if init_params is not None:
            raise NotImplementedError("VerticalSFVI cannot start from init_params.")
        self.setup(data)
        rng_key, init_key = jax.random.split(rng_key)
        server, parties = self._own_states(init_key, data)
        state = self.state_of(server, parties, rng_key, data)
        # strong dtypes as a round returns them, so that rounds compile once
        shapes = jax.eval_shape(lambda s: self._round(s, data, None)[0], state)
        state = jax.tree.map(
            lambda x, y: jax.lax.convert_element_type(x, y.dtype), state, shapes
        )
        self.messages.clear()
        _, info = self.update_with_info(state, data)
        # The guard rejects a party's non-finite reply (its ELBO then reads as 0):
        # the rejection, not the ELBO, names the party.
        rejected = np.asarray(info.rejected).reshape(-1)
        bad = [p for p, r in zip(self._bound.parties, rejected, strict=True) if r]
        if not np.isfinite(float(info.server_elbo)):
            bad = sorted(bad + [SERVER])
        if bad:
            raise VerticalModelError(
                f"The ELBO term of {bad} is not finite on its owner's own view of the "
                "data at initialization (or its reply was rejected as not finite): it "
                "reads arrays, latents or contributions its owner does not hold, or "
                "the model is invalid at the prior's center."
            )
        self.messages.clear()
        return state

    def update_with_info(self, state, data, participating=None):
        """Like :meth:`update`, returning the server's
        :class:`~numpyro_fed.algorithms.vertical_sfvi.VerticalInfo`."""
        if participating is not None:
            raise ValueError("Every party takes part in every vertical round.")
        with row_errors():
            return jax.block_until_ready(super().update_with_info(state, data))

    def run(self, rng_key, num_steps, data, **kwargs) -> RunResult:
        """:meth:`Driver.run <numpyro_fed.infer.driver.Driver.run>`, with a row-index
        mismatch raised as :class:`RowIndexMismatchError`."""
        with row_errors():
            result = super().run(rng_key, num_steps, data, **kwargs)
            return jax.block_until_ready(result)

    def _silo_labels(self) -> list:
        return [f"party {p!r}" for p in self._bound.parties]

    def get_params(self, state: FederatedState) -> VerticalParams:
        """The constrained parameters of ``state``, by owner."""
        fam = self.family
        return VerticalParams(
            fam.constrain(SERVER, state.server.raw),
            {p: fam.constrain(p, s.raw) for p, s in self.party_states(state).items()},
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
        """:func:`~numpyro_fed.algorithms.vertical_reference.joint_elbo` of this
        algorithm: the round's single-sample ELBO computed jointly on pooled data
        (``raws``: owner -> raw parameters; ``rng_key``: ``state.rng_key``)."""
        return vertical_reference.joint_elbo(self, raws, rng_key, data)

    def numpyro_guide(self, init_raws: dict) -> Callable:
        """:func:`~numpyro_fed.algorithms.vertical_reference.numpyro_guide`: the
        family as an ordinary NumPyro guide of the augmented model (full-batch)."""
        return vertical_reference.numpyro_guide(self, init_raws)
