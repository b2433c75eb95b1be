# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""``SFVI``: the NumPyro-style wrapper around :func:`~numpyro_fed.algorithms.sfvi.sfvi`."""

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from numpyro_fed.algorithms._posterior import sample_structured
from numpyro_fed.algorithms._runner import RunResult, run_loop
from numpyro_fed.algorithms.sfvi import (
    SFVIServerState,
    SFVISiloState,
    _constrain,
    _unconstrain,
    noise_keys,
    sfvi,
)
from numpyro_fed.algorithms.sfvi_avg import (
    SFVIAvgServerState,
    SFVIAvgSiloState,
    sfvi_avg,
)
from numpyro_fed.densities import data_template
from numpyro_fed.families.structured import GLOBAL_PREFIX, LOCAL_PREFIX
from numpyro_fed.protocol import silo_data_of
from numpyro_fed.runtime import sequential_round, simulate_round

__all__ = ["SFVI", "SFVIAvg", "SFVIParams", "SFVIState"]


class SFVIState(NamedTuple):
    """- **server** - :class:`~numpyro_fed.algorithms.sfvi.SFVIServerState`.
    - **silos** - :class:`~numpyro_fed.algorithms.sfvi.SFVISiloState`, stacked by silo.
    - **rng_key** - the key the next round splits.
    """

    server: SFVIServerState
    silos: SFVISiloState
    rng_key: jax.Array


class SFVIParams(NamedTuple):
    """Constrained parameters.

    - **theta** - model parameters (``numpyro.param`` sites of the model).
    - **eta_global** - global variational parameters (``loc``, ``scale``, ``tril``).
    - **eta_local** - local variational parameters, stacked ``(J, P, ...)`` by silo
      and unit (in a deployment each silo holds only its own slice).
    """

    theta: dict
    eta_global: dict
    eta_local: dict


class SFVI:
    """
    Structured federated VI (Hassan et al., Algorithm 1) with NumPyro's SVI API.

    One round costs one silo step per silo (all vmapped and jitted together) and one
    server step. With an elementwise optimizer the run equals centralized NumPyro
    ``SVI`` with the same guide; with ``reproducible=True`` (the default in
    simulation) it does so draw for draw, whatever the partition of units into silos.

    :param callable model: a federated model (:func:`~numpyro_fed.federate` or
        :class:`~numpyro_fed.silo_plate`); bind non-split arguments with
        :func:`functools.partial` before federating.
    :param guide: an :class:`~numpyro_fed.AutoStructured` guide of ``model``.
    :param optim: an ``optax.GradientTransformation`` (e.g. ``optax.adam(1e-2)``).
    :param int num_particles: Monte Carlo draws per round.
    :param bool stl: sticking-the-landing gradients (``False``: NumPyro's
        ``Trace_ELBO`` gradients).
    :param bool reproducible: silos derive their local noise from the round key and
        their units' pooled indices, so any partition gives the same draws as
        centralized SVI. ``False``: each silo draws from a key of its own.
    :param str runtime: ``"simulate"`` (vmapped, jitted) or ``"sequential"`` (one silo
        at a time).
    :param float participation: fraction of silos taking part in each round, drawn
        uniformly at random (a runtime option; the server rescales what it gets).

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp, optax
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
        ...     with numpyro.plate("data", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
        >>> fed = nf.federate(model, silos="data")
        >>> data = nf.FederatedData.from_groups([0, 0, 1, 2], y=jnp.array([1.0, 2, 3, 4]))
        >>> svi = nf.SFVI(fed, nf.AutoStructured(fed), optax.adam(0.05))
        >>> result = svi.run(jax.random.key(0), 2000, data, progress_bar=False)
        >>> round(float(result.params.eta_global["loc"][0]), 1)
        2.5
    """

    def __init__(
        self,
        model: Callable,
        guide: Any,
        optim: optax.GradientTransformation,
        *,
        num_particles: int = 1,
        stl: bool = True,
        reproducible: bool = True,
        runtime: str = "simulate",
        participation: float = 1.0,
    ) -> None:
        if not isinstance(optim, optax.GradientTransformation):
            raise TypeError(
                "optim must be an optax.GradientTransformation such as optax.adam(1e-2);"
                f" got {type(optim).__name__}."
            )
        if not isinstance(num_particles, int) or num_particles < 1:
            raise ValueError(
                f"num_particles must be a positive int, got {num_particles!r}."
            )
        if not 0 < participation <= 1:
            raise ValueError(f"participation must be in (0, 1], got {participation!r}.")
        if runtime not in ("simulate", "sequential"):
            raise ValueError(
                f"runtime must be 'simulate' or 'sequential', got {runtime!r}."
            )
        self.model = model
        self.guide = guide
        self.optim = optim
        self.num_particles = num_particles
        self.stl = stl
        self.reproducible = reproducible
        self.runtime = runtime
        self.participation = participation
        self._built: dict = {}

    # ------------------------------------------------------------ construction
    def _layout(self, data: Any) -> tuple:
        return (data.sizes, data.padded_size) + tuple(
            (k, v.shape, str(v.dtype)) for k, v in sorted(data.arrays.items())
        )

    def _build(self, data: Any):
        """The algorithm and its jitted round for this data layout (cached)."""
        layout = self._layout(data)
        if layout not in self._built:
            self.guide.setup(data)
            algorithm = self._make_algorithm(data)
            if self.runtime == "simulate":
                round_fn = jax.jit(partial(simulate_round, algorithm))
            else:
                jitted = type(algorithm)(*(jax.jit(f) for f in algorithm))
                round_fn = partial(sequential_round, jitted)
            self._built[layout] = (algorithm, round_fn)
        return self._built[layout]

    def _make_algorithm(self, data: Any):
        return sfvi(
            self.model,
            self.guide,
            self.optim,
            data_template(data.silo(0)),
            num_particles=self.num_particles,
            stl=self.stl,
            padded=min(data.sizes) < data.padded_size,
        )

    def _check(self, state: SFVIState, data: Any) -> None:
        leaves = jax.tree.leaves(state.silos)
        if not leaves:  # stateless silos (no local latents, stateless optimizer)
            return
        num_silos = leaves[0].shape[0]
        if num_silos != data.num_silos:
            raise ValueError(
                f"The state holds {num_silos} silos but the data hold {data.num_silos}: "
                "initialize SFVI with this data (svi.init(key, data))."
            )

    # -------------------------------------------------------------- NumPyro API
    def init(self, rng_key: jax.Array, data: Any, *, init_params=None) -> SFVIState:
        """
        :param jax.random.key rng_key: random key.
        :param FederatedData data: the silos' data.
        :param SFVIParams init_params: optional starting (constrained) parameters,
            e.g. a previous run's ``result.params`` (warm start).
        :return: the initial state.
        """
        algorithm, _ = self._build(data)
        rng_key, server_key, silo_key = jax.random.split(rng_key, 3)
        silo_data = silo_data_of(data)
        server = jax.jit(algorithm.init_server)(server_key)
        silo_keys = jax.random.split(silo_key, data.num_silos)
        silos = jax.jit(jax.vmap(algorithm.init_silo))(silo_keys, silo_data)
        if init_params is not None:
            server, silos = self._from_params(init_params, data)
        return SFVIState(server, silos, rng_key)

    def _unconstrained(self, params: SFVIParams) -> tuple[dict, dict, dict]:
        """``(theta, eta_global, eta_local)`` of ``params`` in unconstrained space
        (local constraints act elementwise, so they apply to the stacked arrays)."""
        glob_c, loc_c = self.guide.param_constraints()
        return (
            _unconstrain(self.guide.theta_constraints(), params.theta),
            _unconstrain(glob_c, params.eta_global),
            _unconstrain(loc_c, params.eta_local),
        )

    def _from_params(self, params: SFVIParams, data: Any):
        theta, eta_g, eta_l = self._unconstrained(params)
        server = SFVIServerState(theta, eta_g, self.optim.init((theta, eta_g)))
        silo_optim = jax.vmap(lambda eta, _: self.optim.init(eta))(
            eta_l, jnp.arange(data.num_silos)
        )
        silos = SFVISiloState(eta_l, silo_optim)
        return server, silos

    def _round_keys(self, state: SFVIState, num_silos: int):
        rng_key, step_key = jax.random.split(state.rng_key)
        keys = noise_keys(step_key, self.num_particles)
        if self.reproducible:
            silo_keys = jnp.broadcast_to(keys, (num_silos,) + keys.shape)
        else:
            silo_keys = jax.vmap(
                lambda j: jax.vmap(lambda k: jax.random.fold_in(k, j))(keys)
            )(jnp.arange(num_silos))
        return rng_key, keys, silo_keys

    def _participants(self, state: SFVIState, num_silos: int) -> jax.Array | None:
        if self.participation == 1:
            return None
        count = max(1, round(self.participation * num_silos))
        # fold_in, not split: participation must not shift the noise key chain.
        order = jax.random.permutation(
            jax.random.fold_in(state.rng_key, 7919), num_silos
        )
        return jnp.zeros((num_silos,), bool).at[order[:count]].set(True)

    def update(
        self, state: SFVIState, data: Any, participating: jax.Array | None = None
    ) -> tuple[SFVIState, jax.Array]:
        """
        One round.

        :param SFVIState state: current state.
        :param FederatedData data: the silos' data.
        :param jax.Array participating: optional ``(J,)`` booleans naming the silos
            that take part (e.g. silos that dropped out are False); by default all,
            or a random ``participation`` fraction.
        :return: ``(state, loss)``, the loss at the pre-update state.
        """
        self._check(state, data)
        _, round_fn = self._build(data)
        if participating is None:
            participating = self._participants(state, data.num_silos)
        rng_key, keys, silo_keys = self._round_keys(state, data.num_silos)
        server, silos, info = round_fn(
            state.server,
            state.silos,
            silo_data_of(data),
            keys,
            silo_keys,
            participating,
        )
        return SFVIState(server, silos, rng_key), info.loss

    def stable_update(
        self, state: SFVIState, data: Any, participating: jax.Array | None = None
    ) -> tuple[SFVIState, jax.Array]:
        """Like :meth:`update`, but a round whose loss or parameters are not finite
        is not applied (the key still advances)."""
        new_state, loss = self.update(state, data, participating)
        ok = jnp.isfinite(loss) & jnp.all(
            jnp.array(
                [
                    jnp.all(jnp.isfinite(x))
                    for x in jax.tree.leaves(new_state)
                    if jnp.issubdtype(x.dtype, jnp.floating)
                ]
            )
        )
        kept = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, state)
        return kept._replace(rng_key=new_state.rng_key), loss

    def evaluate(self, state: SFVIState, data: Any) -> jax.Array:
        """The loss (negative ELBO estimate) at ``state``, without updating it."""
        return self.update(state, data)[1]

    def get_params(self, state: SFVIState) -> SFVIParams:
        """The constrained parameters of ``state``."""
        glob_c, loc_c = self.guide.param_constraints()
        theta_c = self.guide.theta_constraints()
        return SFVIParams(
            _constrain(theta_c, state.server.theta),
            _constrain(glob_c, state.server.eta_global),
            _constrain(loc_c, state.silos.eta_local),
        )

    def run(
        self,
        rng_key: jax.Array,
        num_steps: int,
        data: Any,
        *,
        progress_bar: bool = True,
        stable_update: bool = False,
        init_state: SFVIState | None = None,
        init_params: SFVIParams | None = None,
    ) -> RunResult:
        """
        Run ``num_steps`` rounds.

        :param jax.random.key rng_key: random key (ignored with ``init_state``).
        :param int num_steps: number of rounds.
        :param FederatedData data: the silos' data.
        :param bool progress_bar: show a tqdm bar (otherwise one ``lax.scan``).
        :param bool stable_update: skip rounds whose result is not finite.
        :param SFVIState init_state: resume from this state.
        :param SFVIParams init_params: start from these parameters (warm start).
        :return: ``RunResult(params, state, losses)``.
        """
        state = (
            init_state
            if init_state is not None
            else self.init(rng_key, data, init_params=init_params)
        )
        update = self.stable_update if stable_update else self.update
        if self.runtime == "simulate":
            step = jax.jit(update)
            state, losses = run_loop(
                lambda s: step(s, data), state, num_steps, progress_bar=progress_bar
            )
        else:  # one silo at a time, in Python: never traced into a scan
            state, losses = run_loop(
                lambda s: update(s, data),
                state,
                num_steps,
                progress_bar=progress_bar,
                scan=False,
            )
        return RunResult(self.get_params(state), state, losses)

    # -------------------------------------------------------------- posterior
    def sample_posterior(
        self,
        rng_key: jax.Array,
        params: SFVIParams,
        data: Any = None,
        *,
        num_samples: int = 1,
    ) -> dict[str, jax.Array]:
        """
        Draw from the fitted joint :math:`q(z_G) \\prod_j q(z_{L_j} \\mid z_G)`.

        :param jax.random.key rng_key: random key.
        :param SFVIParams params: fitted parameters (``result.params``).
        :param FederatedData data: when given, local sites come back in the pooled
            layout (units in the model's original order, ready to compare with NUTS
            on ``data.pooled()``); otherwise stacked by silo, padded units included.
        :param int num_samples: number of draws.
        :return: dict site name -> draws with a leading ``num_samples`` axis.
        """
        return sample_structured(self.guide, rng_key, params, data, num_samples)

    def pooled_params(self, params: SFVIParams, data: Any) -> dict[str, jax.Array]:
        """``params`` under the names and pooled layout of the NumPyro guide
        (``SVI(model, guide, ...)`` with ``init_params=...``, or ``Predictive``)."""
        out = dict(params.theta)
        out.update({GLOBAL_PREFIX + k: v for k, v in params.eta_global.items()})
        for k, v in params.eta_local.items():
            if k == "silo_tril":  # one factor over a whole silo: pooled only if J = 1
                if data.num_silos != 1 or data.padded_size != data.num_units:
                    raise ValueError(
                        "A silo-wide local covariance (local_cov='silo') has no pooled "
                        "layout across several silos: the family depends on the "
                        "partition."
                    )
                out[LOCAL_PREFIX + k] = v[0]
            else:
                out[LOCAL_PREFIX + k] = data.gather_units(v)
        return out


class SFVIAvg(SFVI):
    """
    SFVI-Avg(m) (Hassan et al., Algorithm 2) with NumPyro's SVI API: each round every
    silo takes ``local_steps`` steps on its :math:`N/N_j`-scaled surrogate ELBO and
    sends back only its copy of :math:`(\\theta, \\eta_G)`; the server averages
    :math:`\\theta` and takes the 2-Wasserstein barycenter of the global Gaussians.

    With one silo and the optimizer state carried over, ``R`` rounds of ``m`` steps
    are ``R m`` steps of centralized VI (draw for draw with ``reproducible=True``).

    :param int local_steps: :math:`m`, local steps per round.
    :param bool scale_local_entropy: scale the local entropy by :math:`N/N_j` too
        (spec §3.6; ``False`` is the paper's literal text).
    :param bool weighted: weight the averages by :math:`N_j` (the paper: uniform).
    :param bool reset_optimizer: restart the silos' optimizer of
        :math:`(\\theta, \\eta_G)` every round (default: carry it over).

    Other arguments as in :class:`SFVI`. ``run``'s ``num_steps`` counts rounds.

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp, optax
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
        ...     with numpyro.plate("data", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
        >>> fed = nf.federate(model, silos="data")
        >>> data = nf.FederatedData.from_groups([0, 0, 1, 1], y=jnp.array([1.0, 2, 3, 4]))
        >>> avg = nf.SFVIAvg(fed, nf.AutoStructured(fed), optax.adam(0.05), local_steps=50)
        >>> result = avg.run(jax.random.key(0), 40, data, progress_bar=False)
        >>> round(float(result.params.eta_global["loc"][0]), 1)
        2.5
    """

    def __init__(
        self,
        model: Callable,
        guide: Any,
        optim: optax.GradientTransformation,
        *,
        local_steps: int,
        scale_local_entropy: bool = True,
        weighted: bool = False,
        reset_optimizer: bool = False,
        **kwargs: Any,
    ) -> None:
        if not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(
                f"local_steps must be a positive int, got {local_steps!r}."
            )
        super().__init__(model, guide, optim, **kwargs)
        self.local_steps = local_steps
        self.scale_local_entropy = scale_local_entropy
        self.weighted = weighted
        self.reset_optimizer = reset_optimizer

    def _make_algorithm(self, data: Any):
        return sfvi_avg(
            self.model,
            self.guide,
            self.optim,
            data_template(data.silo(0)),
            data.num_units,
            local_steps=self.local_steps,
            scale_local_entropy=self.scale_local_entropy,
            weighted=self.weighted,
            reset_optimizer=self.reset_optimizer,
            num_particles=self.num_particles,
            stl=self.stl,
            padded=min(data.sizes) < data.padded_size,
        )

    def _round_keys(self, state: SFVIState, num_silos: int):
        # The m local steps continue the key chain exactly as m SFVI rounds would.
        def chain(key, _):
            key, step_key = jax.random.split(key)
            return key, noise_keys(step_key, self.num_particles)

        rng_key, keys = jax.lax.scan(
            chain, state.rng_key, None, length=self.local_steps
        )
        if self.reproducible:
            silo_keys = jnp.broadcast_to(keys, (num_silos,) + keys.shape)
        else:
            silo_keys = jax.vmap(
                lambda j: jax.tree.map(lambda k: jax.random.fold_in(k, j), keys)
            )(jnp.arange(num_silos))
        return rng_key, keys, silo_keys

    def _from_params(self, params: SFVIParams, data: Any):
        theta, eta_g, eta_l = self._unconstrained(params)
        silo_ids = jnp.arange(data.num_silos)
        silos = SFVIAvgSiloState(
            eta_l,
            jax.vmap(lambda eta, _: self.optim.init(eta))(eta_l, silo_ids),
            jax.vmap(lambda _: self.optim.init((theta, eta_g)))(silo_ids),
        )
        return SFVIAvgServerState(theta, eta_g), silos
