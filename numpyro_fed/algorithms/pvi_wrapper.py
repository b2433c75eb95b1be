# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""``PVI``: the NumPyro-style wrapper around :func:`~numpyro_fed.algorithms.pvi.pvi`."""

from functools import partial
from typing import Any, Callable, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers
import numpyro.distributions as dist
from numpyro.distributions import constraints
from numpyro.infer import autoguide
import optax
from tqdm.auto import trange

from numpyro_fed.algorithms.pvi import (
    PVIInfo,
    PVIServerState,
    PVISiloState,
    pvi,
)
from numpyro_fed.algorithms.sfvi import initial_globals
from numpyro_fed.densities import data_template
from numpyro_fed.expfam import GaussianNat, from_moments
from numpyro_fed.families.structured import AutoMeanField, AutoStructured
from numpyro_fed.infer.posterior import sample_structured
from numpyro_fed.protocol import silo_data_of
from numpyro_fed.runtime.pvi_schedules import event_round, synchronous_round
from numpyro_fed.util import constrain

__all__ = ["InvalidCavity", "PVI", "PVIParams", "PVIResult", "PVIState"]

_SCHEDULES = ("synchronous", "sequential", "asynchronous")


class InvalidCavity(ValueError):
    """A silo's cavity :math:`q / t_m` is not a normalizable Gaussian, so its local
    free energy is undefined (Bui et al.'s non-log-concave hazard). ``state`` is the
    state before the offending round, so nothing is lost."""

    def __init__(self, message: str, silo: int, state: Any) -> None:
        super().__init__(message)
        self.silo = silo
        self.state = state


class PVIState(NamedTuple):
    """- **server** - :class:`~numpyro_fed.algorithms.pvi.PVIServerState`.
    - **silos** - :class:`~numpyro_fed.algorithms.pvi.PVISiloState`, stacked by silo.
    - **rng_key** - the round key chain.
    """

    server: PVIServerState
    silos: PVISiloState
    rng_key: jax.Array


class PVIParams(NamedTuple):
    """Constrained parameters, laid out as :class:`~numpyro_fed.SFVIParams`.

    - **theta** - model parameters (``numpyro.param`` sites).
    - **eta_global** - the global Gaussian :math:`q` as the guide's ``loc``, ``scale``
      (and ``tril``).
    - **eta_local** - local guide parameters, stacked ``(J, P, ...)``.
    """

    theta: dict
    eta_global: dict
    eta_local: dict


class PVIResult(NamedTuple):
    """- **params** - final :class:`PVIParams`.
    - **state** - final :class:`PVIState` (resume with ``run(..., init_state=...)``).
    - **losses** - the negative global free energy estimate of every round.
    - **history** - per round: ``q`` (stacked :class:`~numpyro_fed.expfam.GaussianNat`
      at the end of each round) and the :class:`~numpyro_fed.algorithms.pvi.PVIInfo`
      fields.
    """

    params: PVIParams
    state: PVIState
    losses: jax.Array
    history: dict


def _resolve_guide(model: Callable, guide: Any) -> AutoStructured:
    if guide is None:
        return AutoMeanField(model)
    if isinstance(guide, AutoStructured):
        return guide
    if isinstance(guide, (autoguide.AutoNormal, autoguide.AutoDiagonalNormal)):
        return AutoMeanField(model, init_loc_fn=guide.init_loc_fn)
    if isinstance(guide, autoguide.AutoMultivariateNormal):
        return AutoStructured(
            model, global_cov="full", coupling=False, init_loc_fn=guide.init_loc_fn
        )
    raise TypeError(
        f"PVI needs a variational family closed under factor division (mean-field or "
        f"full-rank Gaussian over the global sites); {type(guide).__name__} is not "
        "(low-rank, flow, Delta and Laplace guides have no natural-parameter algebra). "
        "Use nf.AutoMeanField(model), nf.AutoStructured(model, global_cov='full'), "
        "AutoNormal or AutoMultivariateNormal."
    )


def _base(fn):
    while isinstance(fn, (dist.Independent, dist.ExpandedDistribution)):
        fn = fn.base_dist
    return fn


def _site_prior(site: dict, full: bool):
    """The site's prior as (h, prec) over its flattened value, or None if it is not
    Gaussian on an unconstrained support."""
    support = site["fn"].support
    while isinstance(support, constraints.independent):
        support = support.base_constraint
    if support is not constraints.real:
        return None
    shape = jnp.shape(site["value"])
    base = _base(site["fn"])
    if isinstance(base, dist.Normal):
        loc = jnp.broadcast_to(base.loc, shape).reshape(-1)
        prec = jnp.broadcast_to(1.0 / base.scale**2, shape).reshape(-1)
        return prec * loc, jnp.diag(prec) if full else prec
    if full and isinstance(base, dist.MultivariateNormal) and shape == base.loc.shape:
        prec = base.precision_matrix
        return prec @ base.loc, prec
    return None


def _exact_prior(model, guide: AutoStructured, template: dict, theta0: dict):
    """``theta -> GaussianNat``, the prior of the global vector if it is Gaussian in
    unconstrained space with parameters that depend on no other latent site; else
    ``None`` (PVI then refines an in-family factor for it)."""
    full = guide.global_cov == "full"
    names = list(guide.global_specs)

    def prior_of(theta: dict, key=None) -> GaussianNat | None:
        key = jax.random.key(0) if key is None else key
        seeded = handlers.seed(handlers.substitute(model, data=theta), key)
        with handlers.block():
            trace = handlers.trace(seeded).get_trace(**template)
        parts = [_site_prior(trace[n], full) for n in names]
        if any(p is None for p in parts):
            return None
        h = jnp.concatenate([p[0] for p in parts])
        if full:
            prec = jax.scipy.linalg.block_diag(*[p[1] for p in parts])
        else:
            prec = jnp.concatenate([p[1] for p in parts])
        return GaussianNat(h, prec)

    first = prior_of(theta0, jax.random.key(1))
    second = prior_of(theta0, jax.random.key(2))  # other draws of the global sites
    if first is None or second is None:
        return None
    same = all(
        np.allclose(a, b, rtol=0, atol=0)
        for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(second), strict=True)
    )
    return prior_of if same else None


def _moment_matched_prior(model, guide, template, theta, key, num_draws=2000):
    """A robust Gaussian summary of the prior's draws of the global vector in
    unconstrained space (median and interquartile range): t_0's starting point."""

    def draw(k):
        seeded = handlers.seed(handlers.substitute(model, data=theta), k)
        with handlers.block():
            trace = handlers.trace(seeded).get_trace(**template)
        return guide._pack_global({n: trace[n]["value"] for n in guide.global_specs})

    draws = jax.vmap(draw)(jax.random.split(key, num_draws))
    center = jnp.median(draws, 0)
    q25, q75 = jnp.percentile(draws, jnp.array([25.0, 75.0]), axis=0)
    var = jnp.maximum((q75 - q25) / 1.349, 1e-3) ** 2
    if guide.global_cov == "full":
        var = jnp.diag(var)
    return from_moments(center, var)


class PVI:
    """
    Partitioned variational inference (Bui et al.) for a federated NumPyro model,
    with NumPyro's SVI API.

    The global sites get a Gaussian :math:`q = p \\prod_m t_m` (mean-field or
    full-rank, in unconstrained space); each silo keeps its factor :math:`t_m` and its
    local sites' guide, maximizes its local free energy (its own ELBO with the cavity
    :math:`q / t_m` as prior) with its own optimizer, starting from the :math:`q` it
    just received, and sends only :math:`\\Delta\\eta_m`.

    :param callable model: a federated model (:func:`~numpyro_fed.federate`).
    :param guide: :class:`~numpyro_fed.AutoMeanField` (default),
        :class:`~numpyro_fed.AutoStructured` with ``global_cov="full"`` or
        ``"diag"``, or NumPyro's ``AutoNormal`` / ``AutoDiagonalNormal`` /
        ``AutoMultivariateNormal`` (mapped to these). Other families are not closed
        under factor division and are refused.
    :param local_optim: each silo's optax optimizer (default ``optax.adam(1e-2)``).
    :param int local_steps: local optimizer steps per round (or fixed-point
        iterations with ``local_solver="natural"``).
    :param float damping: :math:`\\rho \\in (0, 1]`, the fraction of its update each
        silo sends (1 = undamped; the paper's E.4 "damping factor" is
        :math:`1 - \\rho`). Default: :math:`1/J` for the synchronous schedule (keeps q
        a convex combination of valid Gaussians), 1 otherwise.
    :param str schedule: ``"synchronous"`` (every silo from the same q),
        ``"sequential"`` (one silo after another) or ``"asynchronous"`` (one after
        another, each from a q up to ``max_staleness`` updates old).
    :param float participation: fraction of silos that take part in a round.
    :param int num_particles: Monte Carlo draws per local step.
    :param bool analytic_kl: closed-form KL to the cavity (lower variance).
    :param bool stl: sticking-the-landing gradients for Monte Carlo entropy terms.
    :param str local_solver: ``"adam"`` or ``"natural"`` (fixed-point iteration,
        eq. 10; exact one-step updates for conjugate Gaussian likelihoods).
    :param hyper_optim: the server's optax optimizer for ``numpyro.param`` sites
        (default ``optax.adam(1e-2)``).
    :param int max_staleness: asynchronous schedule: the largest number of updates a
        silo's copy of q may lag behind.
    :param str order: ``"cyclic"`` or ``"random"`` visiting order for the sequential
        and asynchronous schedules.
    :param str init: ``"prior"`` (the paper's :math:`q^{(0)} = p`, all
        :math:`t_m = 1`) or ``"guide"`` (:math:`q^{(0)}` from the guide's
        ``init_loc_fn`` / ``init_scale``, split evenly across the factors; breaks the
        symmetry of neural-network weights).

    **References:**

    1. *Partitioned Variational Inference: A unified framework encompassing federated
       and continual learning*, T. D. Bui, C. V. Nguyen, S. Swaroop, R. E. Turner.

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp, optax
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(x, y=None):
        ...     w = numpyro.sample("w", dist.Normal(0.0, 1.0))
        ...     with numpyro.plate("data", x.shape[0]):
        ...         numpyro.sample("y", dist.Normal(w * x, 0.5), obs=y)
        >>> fed = nf.federate(model, silos="data")
        >>> x = jnp.linspace(-1, 1, 20)
        >>> data = nf.FederatedData.from_groups(jnp.arange(20) % 4, x=x, y=2 * x)
        >>> pvi = nf.PVI(fed, schedule="sequential", local_solver="natural",
        ...              local_steps=1)
        >>> result = pvi.run(jax.random.key(0), 1, data, progress_bar=False)
        >>> prec = 1.0 + jnp.sum(x**2) / 0.25  # the exact conjugate posterior
        >>> mean = jnp.sum(x * 2 * x) / 0.25 / prec
        >>> float(jnp.abs(result.params.eta_global["loc"][0] - mean)) < 1e-6
        True
    """

    def __init__(
        self,
        model: Callable,
        guide: Any = None,
        local_optim: optax.GradientTransformation | None = None,
        *,
        local_steps: int = 10,
        damping: float | None = None,
        schedule: str = "synchronous",
        participation: float = 1.0,
        num_particles: int = 1,
        analytic_kl: bool = True,
        stl: bool = True,
        local_solver: str = "adam",
        hyper_optim: optax.GradientTransformation | None = None,
        max_staleness: int = 2,
        order: str = "cyclic",
        init: str = "prior",
    ) -> None:
        if schedule not in _SCHEDULES:
            raise ValueError(f"schedule must be one of {_SCHEDULES}, got {schedule!r}.")
        if damping is not None and not 0 < damping <= 1:
            raise ValueError(f"damping must be in (0, 1], got {damping!r}.")
        if not 0 < participation <= 1:
            raise ValueError(f"participation must be in (0, 1], got {participation!r}.")
        if not isinstance(local_steps, int) or local_steps < 1:
            raise ValueError(
                f"local_steps must be a positive int, got {local_steps!r}."
            )
        if not isinstance(num_particles, int) or num_particles < 1:
            raise ValueError(
                f"num_particles must be a positive int, got {num_particles!r}."
            )
        if local_solver not in ("adam", "natural"):
            raise ValueError(
                f"local_solver must be 'adam' or 'natural', got {local_solver!r}."
            )
        if order not in ("cyclic", "random"):
            raise ValueError(f"order must be 'cyclic' or 'random', got {order!r}.")
        if init not in ("prior", "guide"):
            raise ValueError(f"init must be 'prior' or 'guide', got {init!r}.")
        if not isinstance(max_staleness, int) or max_staleness < 0:
            raise ValueError(
                f"max_staleness must be a non-negative int, got {max_staleness!r}."
            )
        for name, opt in (("local_optim", local_optim), ("hyper_optim", hyper_optim)):
            if opt is not None and not isinstance(opt, optax.GradientTransformation):
                raise TypeError(
                    f"{name} must be an optax.GradientTransformation such as "
                    f"optax.adam(1e-2); got {type(opt).__name__}."
                )
        self.model = model
        self.guide = _resolve_guide(model, guide)
        self.local_optim = local_optim or optax.adam(1e-2)
        self.hyper_optim = hyper_optim or optax.adam(1e-2)
        self.local_steps = local_steps
        self.damping = damping
        self.schedule = schedule
        self.participation = participation
        self.num_particles = num_particles
        self.analytic_kl = analytic_kl
        self.stl = stl
        self.local_solver = local_solver
        self.max_staleness = max_staleness if schedule == "asynchronous" else 0
        self.order = order
        self.init_from = init
        self._built: dict = {}

    # ------------------------------------------------------------ construction
    def _layout(self, data: Any) -> tuple:
        return (data.sizes, data.padded_size) + tuple(
            (k, v.shape, str(v.dtype)) for k, v in sorted(data.arrays.items())
        )

    def damping_for(self, num_silos: int) -> float:
        """The damping used with ``num_silos`` silos."""
        if self.damping is not None:
            return self.damping
        return 1.0 / num_silos if self.schedule == "synchronous" else 1.0

    def _build(self, data: Any):
        layout = self._layout(data)
        if layout in self._built:
            return self._built[layout]
        roles = self.guide.setup(data)
        if not roles.global_sites:
            raise ValueError(
                "PVI approximates the posterior of global latent sites, and this model "
                "has none (every latent site is inside the silo plate "
                f"{roles.silo_plate!r}); fit each silo on its own instead."
            )
        if self.local_solver == "natural" and roles.local_sites:
            raise NotImplementedError(
                "local_solver='natural' needs a model without local latent sites "
                f"(this one has {list(roles.local_sites)}); use local_solver='adam'."
            )
        template = data_template(data.silo(0))
        theta0 = {k: jnp.asarray(v) for k, (v, _) in self.guide.param_specs.items()}
        prior_of = _exact_prior(self.model, self.guide, template, theta0)
        fns = pvi(
            self.model,
            self.guide,
            self.local_optim,
            template,
            local_steps=self.local_steps,
            damping=self.damping_for(data.num_silos),
            prior_of=prior_of,
            num_particles=self.num_particles,
            analytic_kl=self.analytic_kl,
            stl=self.stl,
            local_solver=self.local_solver,
            padded=min(data.sizes) < data.padded_size,
            **self._pvi_options(prior_of),
        )
        if self.schedule == "synchronous":
            round_fn = jax.jit(partial(synchronous_round, fns, self.hyper_optim))
        else:
            round_fn = jax.jit(partial(event_round, fns, self.hyper_optim))
        self._built[layout] = (fns, round_fn, template)
        return self._built[layout]

    def _pvi_options(self, prior_of: Callable | None) -> dict:
        """Extra arguments of :func:`~numpyro_fed.algorithms.pvi.pvi` (Fed-GVI's
        loss, cavity and divergence); none for PVI."""
        del prior_of
        return {}

    def _check(self, state: PVIState, data: Any) -> None:
        num_silos = state.silos.factor.h.shape[0]
        if num_silos != data.num_silos:
            raise ValueError(
                f"The state holds {num_silos} silos but the data hold {data.num_silos}: "
                "initialize PVI with this data (pvi.init(key, data))."
            )

    # -------------------------------------------------------------- NumPyro API
    def init(self, rng_key: jax.Array, data: Any) -> PVIState:
        """
        :param jax.random.key rng_key: random key.
        :param FederatedData data: the silos' data.
        :return: the initial state: :math:`q^{(0)} = p` and :math:`t_m = 1` (or the
            guide's initial q, see ``init``).
        """
        fns, _, template = self._build(data)
        rng_key, init_key, silo_key, prior_key = jax.random.split(rng_key, 4)
        theta, _ = initial_globals(self.guide, init_key, template)
        if fns.prior_of is not None:
            prior = fns.prior_of(theta)
            prior_silo = None
        else:
            prior = _moment_matched_prior(
                self.model,
                self.guide,
                template,
                constrain(self.guide.theta_constraints(), theta),
                prior_key,
            )
            prior_silo = fns.init_prior_silo(jax.random.fold_in(prior_key, 1), prior)
            prior_silo = prior_silo._replace(factor=prior)
        q0 = prior
        keys = jax.random.split(silo_key, data.num_silos)
        silos = jax.vmap(fns.init_silo, in_axes=(0, 0, None))(
            keys, silo_data_of(data), q0
        )
        if self.init_from == "guide":
            start = fns.from_guide(self.guide.init_global(init_key, template))
            share = start.minus(prior).times(1.0 / data.num_silos)
            silos = silos._replace(
                factor=jax.tree.map(
                    lambda x: jnp.broadcast_to(x, (data.num_silos,) + x.shape), share
                )
            )
            q0 = prior.plus(share.times(float(data.num_silos)))
        stale = None
        if self.schedule == "asynchronous":
            stale = jax.tree.map(
                lambda x: jnp.broadcast_to(x, (self.max_staleness + 1,) + x.shape), q0
            )
        optim_state = self.hyper_optim.init(theta)
        server = PVIServerState(q0, prior, theta, optim_state, prior_silo, stale)
        # Strong dtypes: weak-typed leaves would make the jitted round recompile
        # after the first rounds.
        state = jax.tree.map(
            lambda x: jnp.asarray(x, x.dtype) if hasattr(x, "dtype") else x,
            PVIState(server, silos, rng_key),
        )
        return state

    @partial(jax.jit, static_argnums=(0, 2))
    def _round_inputs(self, rng_key: jax.Array, num_silos: int):
        # One compiled call per round instead of a string of small eager ops.
        rng_key, key = jax.random.split(rng_key)
        part_key, order_key, lag_key, server_key = jax.random.split(key, 4)
        participating = jnp.ones((num_silos,), bool)
        if self.participation < 1:
            count = max(1, round(self.participation * num_silos))
            chosen = jax.random.permutation(part_key, num_silos)[:count]
            participating = jnp.zeros((num_silos,), bool).at[chosen].set(True)
        order = jnp.arange(num_silos)
        if self.order == "random":
            order = jax.random.permutation(order_key, num_silos)
        staleness = jax.random.randint(lag_key, (num_silos,), 0, self.max_staleness + 1)
        return rng_key, participating, order, staleness, server_key

    def update(
        self, state: PVIState, data: Any, participating: jax.Array | None = None
    ) -> tuple[PVIState, PVIInfo]:
        """
        One round: every (participating) silo updates once.

        :param PVIState state: current state.
        :param FederatedData data: the silos' data.
        :param jax.Array participating: optional ``(J,)`` booleans (e.g. silos that
            dropped out are False); by default all, or a random ``participation``
            fraction.
        :return: ``(state, info)``.
        :raises InvalidCavity: when a silo's cavity is not a valid Gaussian (the
            exception carries the state before the round).
        """
        self._check(state, data)
        _, round_fn, _ = self._build(data)
        rng_key, chosen, order, staleness, server_key = self._round_inputs(
            state.rng_key, data.num_silos
        )
        if participating is None:
            participating = chosen
        participating = jnp.asarray(participating, bool)
        if participating.shape != (data.num_silos,):
            raise ValueError(
                f"participating must have shape ({data.num_silos},), got "
                f"{participating.shape}."
            )
        args = (
            state.server,
            state.silos,
            silo_data_of(data),
            server_key,
            participating,
        )
        if self.schedule != "synchronous":
            args = args + (order, staleness)
        server, silos, info = round_fn(*args)
        bad = int(info.invalid_cavity)
        if bad >= 0:
            raise InvalidCavity(
                f"Silo {bad}'s cavity q / t_{bad} is not a valid Gaussian (its precision "
                "is not positive definite), so its local free energy is undefined. "
                "This happens with non-log-concave likelihoods and weak priors; use "
                "a stronger prior, more damping, or a sequential schedule.",
                bad,
                state,
            )
        return PVIState(server, silos, rng_key), info

    def get_params(self, state: PVIState) -> PVIParams:
        """The constrained parameters of ``state``."""
        _, local_c = self.guide.param_constraints()
        fns = next(iter(self._built.values()))[0]
        return PVIParams(
            constrain(self.guide.theta_constraints(), state.server.theta),
            fns.to_guide(state.server.q),
            constrain(local_c, state.silos.eta_local),
        )

    def run(
        self,
        rng_key: jax.Array,
        num_rounds: int,
        data: Any,
        *,
        progress_bar: bool = True,
        init_state: PVIState | None = None,
    ) -> PVIResult:
        """
        Run ``num_rounds`` rounds.

        :param jax.random.key rng_key: random key (ignored with ``init_state``).
        :param int num_rounds: number of rounds.
        :param FederatedData data: the silos' data.
        :param bool progress_bar: show a tqdm bar.
        :param PVIState init_state: resume from this state.
        :return: :class:`PVIResult`.
        """
        if not isinstance(num_rounds, int) or num_rounds < 1:
            raise ValueError(f"num_rounds must be a positive int, got {num_rounds!r}.")
        state = init_state if init_state is not None else self.init(rng_key, data)
        self._check(state, data)
        qs, infos = [], []
        batch = max(num_rounds // 20, 1)
        with trange(num_rounds, desc="PVI rounds", disable=not progress_bar) as bar:
            for i in bar:
                state, info = self.update(state, data)
                qs.append(state.server.q)
                infos.append(info)
                if progress_bar and (i + 1) % batch == 0:
                    recent = -np.mean([float(x.elbo) for x in infos[-batch:]])
                    bar.set_postfix_str(f"avg. loss: {recent:.4f}", refresh=False)
        history = {"q": jax.tree.map(lambda *x: jnp.stack(x), *qs)}
        for field in PVIInfo._fields:
            history[field] = jnp.stack([getattr(x, field) for x in infos])
        rejected = int(jnp.sum(history["num_rejected"]))
        if rejected:
            warnings.warn(
                f"PVI rejected {rejected} non-finite silo update(s); those silos kept "
                "their factors.",
                stacklevel=2,
            )
        shrunk = int(jnp.sum(history["scale"] < 1))
        if shrunk:
            warnings.warn(
                f"In {shrunk} round(s) the server shrank an update (smallest applied "
                f"fraction {float(jnp.min(history['scale'])):.3g}) to keep q a valid "
                "Gaussian; consider more damping.",
                stacklevel=2,
            )
        return PVIResult(self.get_params(state), state, -history["elbo"], history)

    def factor_sum(self, state: PVIState) -> GaussianNat:
        """:math:`\\eta_0 + \\sum_m \\eta_m` recomputed from the silos' factors (equals
        ``state.server.q`` at every round: the paper's Property 2)."""
        total = jax.tree.map(lambda x: jnp.sum(x, 0), state.silos.factor)
        return state.server.prior.plus(total)

    def sample_posterior(
        self,
        rng_key: jax.Array,
        params: PVIParams,
        data: Any = None,
        *,
        num_samples: int = 1,
    ) -> dict[str, jax.Array]:
        """Draws of every latent site from :math:`q(z_G) \\prod_j q(z_{L_j})`; local
        sites in the pooled layout when ``data`` is given (see
        :meth:`~numpyro_fed.SFVI.sample_posterior`)."""
        return sample_structured(self.guide, rng_key, params, data, num_samples)
