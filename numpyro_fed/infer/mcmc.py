# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""``FSGLD`` and ``DSGLD``: NumPyro MCMC kernels over
:func:`~numpyro_fed.algorithms.sgld.fsgld`, as NumPyro's ``SA`` wraps ``_sa``.

One MCMC sample is one contact of
:func:`~numpyro_fed.runtime.contact_round` with one Langevin step per contact: the
kernel runs the algorithm's own ``select``, ``silo_step`` and ``server_step``, so the
chain it samples is the chain that every runtime drives (:meth:`FSGLD.run_protocol`
runs it as messages under the sequential runtime).

**References:**

1. *Federated Stochastic Gradient Langevin Dynamics*, K. El Mekkaoui, D. Mesquita,
   P. Blomstedt, S. Kaski (UAI 2021), Algorithm 1, Eqs. 3-7.
2. *Distributed Stochastic Gradient MCMC*, S. Ahn, B. Shahbaba, M. Welling (ICML 2014).
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMCKernel
from numpyro.util import identity, is_prng_key

from numpyro_fed.algorithms.sgld import (
    FSGLDServerState,
    FSGLDSiloState,
    SGLDConfig,
    conducive_factors,
    fsgld,
    init_chain,
)
from numpyro_fed.algorithms.sgld_bounds import (
    check_step_size,
    conducive_bound,
)
from numpyro_fed.checks import check_count, check_state_layout
from numpyro_fed.data import FederatedData
from numpyro_fed.expfam import GaussianNat
from numpyro_fed.infer.sgld_protocol import ProtocolResult, run_chain
from numpyro_fed.potentials import FederatedPotential, federated_potential
from numpyro_fed.protocol import FederatedAlgorithm, jit_algorithm, silo_data_of
from numpyro_fed.runtime import contact_round
from numpyro_fed.sgld_diagnostics import warn_diverged, warn_lagging_locals
from numpyro_fed.surrogates import check_surrogates
from numpyro_fed.util import all_finite

__all__ = ["DSGLD", "FSGLD", "SGLDState"]


class SGLDState(NamedTuple):
    """State of a DSGLD/FSGLD chain.

    - **z** - unconstrained position: global sites, and local sites stacked
      ``(J, P, ...)`` by silo and padded unit.
    - **step** - the global step counter :math:`t` (steps taken so far); it drives
      the annealed step size and the silo schedule.
    - **silo** - the silo :math:`c_r` holding the chain (the one the next step runs on).
    - **rng_key** - the chain's key (the server's): it draws the silo of each visit
      (and, with ``reproducible=True``, the silos' minibatches and noise).
    - **silo_keys** - ``(J,)`` keys, each silo's own: step :math:`t` on silo
      :math:`s` draws its minibatch and noise from ``fold_in(silo_keys[s], t)``
      (unused with ``reproducible=True``). The kernel simulates every party; in a
      deployment each silo holds only its own key.
    - **diverged_at** - the step (0-based, like ``step``) on which the chain first
      left finite values, -1 while finite (warned of on the host,
      :meth:`FSGLD.warn_divergence`, never inside the compiled loop).
    - **diverged_silo** - the silo that step ran on (-1 while finite).
    """

    z: dict
    step: jax.Array
    silo: jax.Array
    rng_key: jax.Array
    silo_keys: jax.Array
    diverged_at: jax.Array
    diverged_silo: jax.Array


def _check_probs(silo_probs: Any, num_silos: int | None = None) -> np.ndarray | None:
    if silo_probs is None:
        return None
    f = np.asarray(silo_probs, dtype=float)
    if f.ndim != 1 or not np.all(f > 0) or not abs(f.sum() - 1) < 1e-6:
        raise ValueError(
            "silo_probs must be positive probabilities, one per silo, summing to 1; "
            f"got {f.tolist()} (sum {f.sum():.6g})."
        )
    if num_silos is not None and len(f) != num_silos:
        raise ValueError(
            f"silo_probs has {len(f)} entries but the data hold {num_silos} silos."
        )
    return f


def pooled_model(model: Callable) -> Callable:
    """``model`` called on ``FederatedData.pooled()``: what ArviZ and ``Predictive``
    run with the kernel's ``(data,)`` arguments."""

    def pooled(data: Any, *args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs, **data.pooled())

    return pooled


def _sample(
    algorithm: FederatedAlgorithm, pot: FederatedPotential, state: SGLDState, data
) -> SGLDState:
    """One contact (one Langevin step) of the chain in ``state``."""
    z_global, z_local = pot.split(state.z)
    server = FSGLDServerState(z_global, state.step, state.silo, state.rng_key)
    # The server's steps ignore their key (the chain key is in its state); the
    # contacted silo gets its own key, and fold_in(key, t) makes it fresh every step.
    server, silos, _ = contact_round(
        algorithm,
        server,
        FSGLDSiloState(z_local),
        silo_data_of(data, pot.nested),
        state.rng_key,
        state.silo_keys[state.silo],
    )
    z = {**server.z_global, **silos.z_local}
    # Recorded, not reported: a per-step cond + host callback cost ~3.2 us a step.
    went = (state.diverged_at < 0) & ~all_finite(z)
    return state._replace(
        z=z,
        step=server.step,
        silo=server.silo,
        rng_key=server.rng_key,
        diverged_at=jnp.where(went, state.step, state.diverged_at),
        diverged_silo=jnp.where(went, state.silo, state.diverged_silo),
    )


class FSGLD(MCMCKernel):
    """
    Federated SGLD with conducive gradients (El Mekkaoui et al., Algorithm 1) as a
    NumPyro :class:`~numpyro.infer.mcmc.MCMCKernel`. One MCMC sample is one Langevin
    step; run it with ``MCMC(...).run(rng_key, data)`` on a
    :class:`~numpyro_fed.FederatedData`, then use ``get_samples``, ``print_summary``
    and ``arviz.from_numpyro`` as with NUTS (local sites come back in pooled order).

    :param callable model: a federated model (:func:`~numpyro_fed.federate` or
        :class:`~numpyro_fed.silo_plate`) called with the silo arrays only.
    :param step_size: :math:`h`, a positive float, or a callable ``t -> h_t`` of the
        global step counter (e.g.
        :func:`~numpyro_fed.algorithms.sgld.annealed_step_size`).
    :param GaussianNat surrogates: one :math:`q_s` per silo, stacked, from
        :func:`~numpyro_fed.fit_surrogates`.
    :param int tau: local steps per visit (Algorithm 1's :math:`T`).
    :param silo_probs: :math:`f`, visit probabilities (default uniform).
    :param float alpha: weight of the conducive gradient (Eq. 7).
    :param int batch_size: minibatch size ``m`` per silo (default: the whole silo).
    :param bool replace: draw minibatches with replacement (the authors' code).
    :param callable init_strategy: NumPyro init strategy for the initial position.
    :param bool reproducible: the chain's key travels with the chain and every silo
        draws its minibatch and noise from it, so the server can replay them (and,
        with ``batch_size=1``, recover a silo's data row from one step; see
        ``docs/privacy.md``). Default ``False``: each silo draws from a key of its
        own (:class:`SGLDState`'s ``silo_keys``). Both modes give the same chain
        law; only the draws differ.
    :param int local_steps: ``K``: before each step the chain's silo refreshes its
        local sites by ``K`` MALA moves at the fixed globals, and the step averages
        the global gradient over them; 0: locals and globals step together (with
        many small silos the locals lag and the sds inflate, ``docs/fsgld.md``).
        Default ``None``: 5 when the model has local sites and the data several
        silos, else 0.
    :param local_step_size: :math:`h^L` of those moves, a float or ``t -> h^L_t``
        (default :math:`h_t / f_s`).
    :param float conducive_radius: evaluate the conducive gradient no further than
        this many standard deviations of the surrogates' product from its mean
        (:func:`~numpyro_fed.algorithms.sgld_bounds.bounded_position`; unbiased,
        and bounded far out, where a linear term outgrows a funnel's likelihood);
        default 4; ``None``: unbounded, as in the paper.

    A chain that leaves finite values shows NaNs and is warned of on the host, with
    its step, silo and step size (:meth:`warn_divergence` says when).

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp
        >>> import numpyro, numpyro.distributions as dist
        >>> from numpyro.infer import MCMC
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
        ...     with nf.silo_plate("data", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
        >>> y = jnp.arange(40.0) / 10
        >>> data = nf.FederatedData.from_groups(jnp.arange(40) // 10, y=y)
        >>> q = nf.fit_surrogates(model, data)
        >>> kernel = nf.FSGLD(model, 5e-3, q, tau=10)
        >>> mcmc = MCMC(kernel, num_warmup=200, num_samples=2000, progress_bar=False)
        >>> mcmc.run(jax.random.key(0), data)
        >>> mean = float(mcmc.get_samples()["mu"].mean())  # posterior: 1.95 +- 0.16
        >>> abs(mean - 1.95) < 0.08
        True
    """

    sample_field = "z"
    _needs_surrogates = True

    def __init__(
        self,
        model: Callable,
        step_size: Any,
        surrogates: GaussianNat | None,
        tau: int = 1,
        silo_probs: Any = None,
        alpha: float = 1.0,
        batch_size: int | None = None,
        *,
        replace: bool = True,
        init_strategy: Callable = init_to_uniform,
        reproducible: bool = False,
        local_steps: int | None = None,
        local_step_size: Any = None,
        conducive_radius: float | None = 4.0,
    ) -> None:
        self._model = model
        self._local_steps = (
            None if local_steps is None else check_count("local_steps", local_steps, 0)
        )
        self._local_step_size = (
            None if local_step_size is None else check_step_size(local_step_size)
        )
        self._step_size = check_step_size(step_size)
        if isinstance(tau, bool) or not isinstance(tau, (int, np.integer)) or tau < 1:
            raise ValueError(
                f"tau (local steps per visit) must be an int >= 1, got {tau!r}."
            )
        if batch_size is not None and (
            not isinstance(batch_size, (int, np.integer)) or batch_size < 1
        ):
            raise ValueError(
                f"batch_size must be None or an int >= 1, got {batch_size!r}."
            )
        if not np.isfinite(alpha):
            raise ValueError(f"alpha must be finite, got {alpha!r}.")
        if surrogates is None and self._needs_surrogates:
            raise TypeError(
                "FSGLD needs the silos' surrogates (nf.fit_surrogates(model, data)); "
                "without them it is DSGLD: use nf.DSGLD(model, step_size, ...)."
            )
        if surrogates is not None:
            check_surrogates(surrogates)
        self._bound = None
        if conducive_radius is not None:
            if surrogates is None:
                raise ValueError("conducive_radius bounds FSGLD's conducive gradient.")
            self._bound = conducive_bound(surrogates, conducive_radius)
        self._surrogates = surrogates
        self._tau = int(tau)
        self._silo_probs = _check_probs(silo_probs)
        self._alpha = float(alpha)
        self._batch_size = batch_size
        self._replace = bool(replace)
        self._init_strategy = init_strategy
        self._reproducible = bool(reproducible)
        self._built: dict = {}
        self._sample_fn = None
        self._warned: set = set()

    # ------------------------------------------------------------ construction
    @staticmethod
    def _data(model_args: tuple, model_kwargs: dict | None) -> Any:
        if (
            model_kwargs
            or len(model_args) != 1
            or not isinstance(model_args[0], FederatedData)
        ):
            raise TypeError(
                "Run the kernel as MCMC(kernel, ...).run(rng_key, data) with one "
                "FederatedData; bind other model arguments with functools.partial."
            )
        return model_args[0]

    @staticmethod
    def _layout(data: Any) -> tuple:
        return (data.sizes, data.padded_size) + tuple(
            (k, v.shape, str(v.dtype)) for k, v in sorted(data.arrays.items())
        )

    def _setup(self, data: Any) -> tuple[FederatedPotential, SGLDConfig]:
        layout = self._layout(data)
        if layout not in self._built:
            pot = federated_potential(self._model, data)
            f = _check_probs(self._silo_probs, data.num_silos)
            if f is None:
                f = np.full(data.num_silos, 1.0 / data.num_silos)
            if self._surrogates is not None:
                check_surrogates(self._surrogates, data.num_silos, pot.global_dim)
            local_steps = self._local_steps
            if local_steps is None:  # refresh the locals where they would lag
                local_steps = 5 if pot.local_sites and data.num_silos > 1 else 0
            warn_lagging_locals(pot, f, local_steps, type(self).__name__)
            if self._batch_size is not None and not self._replace:
                if self._batch_size > min(data.sizes):
                    raise ValueError(
                        f"batch_size={self._batch_size} exceeds the smallest silo "
                        f"({min(data.sizes)} units): draw with replace=True or use a "
                        "smaller batch."
                    )
            conducive = None
            if self._surrogates is not None:
                conducive = conducive_factors(self._surrogates, f, self._alpha)
            cfg = SGLDConfig(
                self._step_size,
                self._tau,
                jnp.asarray(f),
                self._alpha,
                conducive,
                self._batch_size,
                self._replace,
                local_steps,
                self._local_step_size,
                self._bound,
            )
            self._built[layout] = (pot, cfg)
        return self._built[layout]

    def potential(self, data: Any) -> FederatedPotential:
        """The model's :class:`~numpyro_fed.potentials.FederatedPotential` on ``data``."""
        return self._setup(data)[0]

    def config(self, data: Any) -> SGLDConfig:
        """The chain's :class:`~numpyro_fed.algorithms.sgld.SGLDConfig` on ``data``."""
        return self._setup(data)[1]

    def algorithm(
        self,
        data: Any,
        steps_per_contact: int | None = None,
        reject_nonfinite: bool = True,
    ) -> FederatedAlgorithm:
        """The chain as a :class:`~numpyro_fed.FederatedAlgorithm` on ``data``
        (:func:`~numpyro_fed.algorithms.sgld.fsgld`; ``steps_per_contact`` defaults to
        ``tau``; the kernel itself takes 1 and does not reject non-finite steps)."""
        pot, cfg = self._setup(data)
        return fsgld(
            pot,
            cfg,
            self._init_strategy,
            steps_per_contact=steps_per_contact,
            reject_nonfinite=reject_nonfinite,
            reproducible=self._reproducible,
        )

    # -------------------------------------------------------------- NumPyro API
    @property
    def model(self) -> Callable:
        """The model on pooled data, ``model(data)``, as ArviZ expects."""
        return pooled_model(self._model)

    @property
    def default_fields(self) -> tuple[str, ...]:
        return ("z",)

    def init(
        self, rng_key, num_warmup, init_params=None, model_args=(), model_kwargs=None
    ):
        """
        :param jax.random.key rng_key: the chain's key (or one key per chain for
            ``chain_method="vectorized"``).
        :param int num_warmup: burn-in steps (no adaptation: counted like samples).
        :param dict init_params: an unconstrained starting position (global sites;
            local sites stacked ``(J, P, ...)``), or ``None`` for ``init_strategy``.
        :return: the initial :class:`SGLDState`.
        """
        del num_warmup
        data = self._data(model_args, model_kwargs)
        pot, cfg = self._setup(data)

        def one(key, z=None):
            # split(key, 3)[:2] == split(key): the start and the chain key do not
            # depend on the mode.
            init_key, chain_key, silo_key = jax.random.split(key, 3)
            if z is None:
                z = pot.init_position(init_key, data, self._init_strategy)
            z = jax.tree.map(jnp.asarray, z)
            server = init_chain(cfg, pot.split(z)[0], chain_key)
            silo_keys = jax.random.split(silo_key, data.num_silos)
            never = jnp.full_like(server.step, -1)  # diverged_at, diverged_silo
            return SGLDState(z, *server[1:], silo_keys, never, never)

        if is_prng_key(rng_key):
            state = one(rng_key, init_params)
        elif init_params is None:
            state = jax.vmap(one)(rng_key)
        else:
            state = jax.vmap(one)(rng_key, init_params)
        self._sample_fn = self._step  # MCMC calls init while this is None
        self._warned = set()  # a new run: its divergences are new
        return state

    def _check_position(
        self, z: dict, data: Any, silo_keys: Any = None
    ) -> FederatedPotential:
        """Raise unless ``z`` (and ``silo_keys``) fit ``data``'s layout; return the
        potential there."""
        pot = self.potential(data)
        shapes = {s.name: s.unconstrained_shape for s in pot.global_sites}
        shapes.update(
            {s.name: (data.num_silos,) + s.unconstrained_shape for s in pot.local_sites}
        )
        expected = {k: jax.ShapeDtypeStruct(v, float) for k, v in shapes.items()}
        fix = "start the chain on these data (init, or a new MCMC run)"
        name = type(self).__name__
        check_state_layout(name, z, expected, fix, dtypes=False, root="state.z")
        if silo_keys is not None and jnp.shape(silo_keys)[0] != data.num_silos:
            raise ValueError(
                f"{name}: state.silo_keys holds {jnp.shape(silo_keys)[0]} silos' keys "
                f"but the data hold {data.num_silos} silos; {fix}."
            )
        return pot

    def _step(self, state: SGLDState, data: Any) -> SGLDState:
        """One chain's step on ``data``, whose layout the chain must have."""
        pot = self._check_position(state.z, data, state.silo_keys)
        key = ("kernel",) + self._layout(data)
        if key not in self._built:
            # NaNs of a diverging chain show in its samples, as with NumPyro's kernels.
            self._built[key] = self.algorithm(
                data, steps_per_contact=1, reject_nonfinite=False
            )
        return _sample(self._built[key], pot, state, data)

    def sample(
        self, state: SGLDState, model_args: tuple, model_kwargs: dict
    ) -> SGLDState:
        """One Langevin step: one contact of the chain's silo (a state of another
        data layout is refused, naming the site)."""
        data = self._data(model_args, model_kwargs)
        one = is_prng_key(state.rng_key)
        return (self._step if one else jax.vmap(self._step, (0, None)))(state, data)

    def postprocess_fn(self, model_args: tuple, model_kwargs: dict) -> Callable:
        """Unconstrained position -> constrained sites, local sites in pooled order."""
        if not model_args:
            return identity
        data = self._data(model_args, model_kwargs)
        pot = self._setup(data)[0]

        def constrain(z: dict) -> dict:
            self._check_position(z, data)
            z_global, z_local = pot.split(z)
            values = pot.constrain(z_global)
            values.update(data.gather_units(pot.constrain(z_local)))
            return values

        return constrain

    def get_diagnostics_str(self, state: SGLDState) -> str:
        """The progress bar's postfix, which NumPyro asks for on the host after each
        step of one chain (and of each sequential chain): it also warns, once, of a
        divergence during ``MCMC.run`` (:meth:`warn_divergence`)."""
        self.warn_divergence(state, chains=False, once=True)
        return f"silo {int(state.silo)}, h={float(self._step_size(state.step)):.2e}"

    def warn_divergence(
        self, state: SGLDState, *, chains: bool = True, once: bool = False
    ) -> bool:
        """
        Warn naming the chains of ``state`` that left finite values, their step,
        silo and step size (:func:`~numpyro_fed.sgld_diagnostics.warn_diverged`).
        A warning from inside NumPyro's compiled loop costs a ``cond`` a step
        (~3.2 us on CPU), so the state records the step and this reads it on the
        host: NumPyro's progress bar after every step of one chain
        (:meth:`get_diagnostics_str`; not with ``progress_bar=False``, nor for
        ``"vectorized"`` or ``"parallel"`` chains), and ``nf.to_arviz(mcmc)``,
        ``nf.compare`` and :func:`~numpyro_fed.sgld_diagnostics.warn_low_ess` on
        ``mcmc.last_state`` (every chain method).

        :param SGLDState state: one chain's state, or chains stacked along the
            leading axis (``mcmc.last_state``).
        :param bool chains: name the chains by index (one chain's state: chain 0).
        :param bool once: leave out those warned of since the kernel's ``init``.
        :return: whether it warned.
        """
        seen = self._warned if once else None
        name = type(self).__name__
        return warn_diverged(name, state, self._step_size, chains=chains, seen=seen)

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_sample_fn"] = None
        state["_built"] = {}
        state["_warned"] = set()
        return state

    # --------------------------------------------------------------- protocol
    def run_protocol(
        self,
        rng_key: jax.Array,
        data: Any,
        num_rounds: int,
        *,
        init_params: dict | None = None,
    ) -> ProtocolResult:
        """
        Run the chain as messages between a server and the silos under the sequential
        runtime (:func:`~numpyro_fed.runtime.sequential_round`): each round the server
        sends the chain (global position and step counter; the chain's key too with
        ``reproducible=True``) to the silo it selected, which returns its
        ``tau``-step trajectory (drawn from the silo's own key, the kernel's
        ``silo_keys``). Starting from the same ``rng_key``
        it reproduces ``MCMC(kernel, num_warmup=0, num_samples=num_rounds * tau)
        .run(rng_key, data)`` draw for draw on the global sites. Bytes are read off
        the messages' shapes (:func:`~numpyro_fed.runtime.round_bytes`).

        :param jax.random.key rng_key: the chain's key (as given to ``MCMC.run``).
        :param FederatedData data: the silos' data.
        :param int num_rounds: chain handoffs.
        :param dict init_params: optional unconstrained starting position.
        :rtype: ProtocolResult
        """
        num_rounds = check_count("num_rounds", num_rounds)
        first = self.init(rng_key, 0, init_params, (data,), {})
        algorithm = jit_algorithm(self.algorithm(data))
        return run_chain(
            type(self).__name__,
            algorithm,
            self.potential(data),
            first,
            data,
            num_rounds,
            self._surrogates,
            self._tau,
        )


class DSGLD(FSGLD):
    """
    Distributed SGLD (Ahn et al. 2014; El Mekkaoui et al., Eqs. 3-4): :class:`FSGLD`
    without the conducive gradient (:func:`~numpyro_fed.algorithms.sgld.dsgld`).

    :param callable model: a federated model.
    :param step_size: :math:`h` or a callable ``t -> h_t``.
    :param int tau: local steps per visit.
    :param silo_probs: :math:`f` (default uniform).
    :param int batch_size: minibatch size per silo (default: the whole silo).
    :param bool replace: draw minibatches with replacement.
    :param callable init_strategy: NumPyro init strategy.
    :param bool reproducible: as in :class:`FSGLD` (default ``False``: each silo
        draws from its own key).
    :param int local_steps: as in :class:`FSGLD`.
    :param local_step_size: as in :class:`FSGLD` (divergences are warned of as there).

    **Example:**

    .. doctest::

        >>> import numpyro_fed as nf
        >>> def model(y): ...
        >>> nf.DSGLD(model, 1e-3, tau=0)
        Traceback (most recent call last):
        ...
        ValueError: tau (local steps per visit) must be an int >= 1, got 0.
    """

    _needs_surrogates = False

    def __init__(
        self,
        model: Callable,
        step_size: Any,
        tau: int = 1,
        silo_probs: Any = None,
        batch_size: int | None = None,
        *,
        replace: bool = True,
        init_strategy: Callable = init_to_uniform,
        reproducible: bool = False,
        local_steps: int | None = None,
        local_step_size: Any = None,
    ) -> None:
        super().__init__(
            model,
            step_size,
            None,
            tau,
            silo_probs,
            0.0,
            batch_size,
            replace=replace,
            init_strategy=init_strategy,
            reproducible=reproducible,
            local_steps=local_steps,
            local_step_size=local_step_size,
            conducive_radius=None,
        )
