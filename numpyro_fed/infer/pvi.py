# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""``PVI``: the NumPyro-style class over :func:`~numpyro_fed.algorithms.pvi.pvi`
(``FedGVI``, its generalized version, is in :mod:`numpyro_fed.infer.fedgvi`)."""

from typing import Any, Callable, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer import autoguide
import optax

from numpyro_fed.algorithms.pvi import pvi
from numpyro_fed.checks import check_count, check_optimizer
from numpyro_fed.densities import data_template
from numpyro_fed.expfam import (
    CURVATURES,
    GaussianNat,
    from_loc_scale,
    gaussian_prior,
    guide_params,
)
from numpyro_fed.families.structured import AutoGlobalLocalNormal, AutoMeanField
from numpyro_fed.infer.driver import Driver, FederatedState, RunResult
from numpyro_fed.infer.posterior import sample_structured
from numpyro_fed.infer.pvi_checks import check_run
from numpyro_fed.infer.vi import local_params, pooled_guide_params
from numpyro_fed.partition import nested_sizes
from numpyro_fed.util import constrain

__all__ = ["InvalidCavity", "PVI", "PVIParams"]

# PVI's schedules are runtimes of the driver: synchronous is the vmapped simulation,
# sequential and asynchronous are events without and with staleness.
_SCHEDULES = {
    "synchronous": "simulate",
    "sequential": "events",
    "asynchronous": "events",
}


# Sequential Adam local steps: 200 one-group silos end 7 % too narrow, 2,000 collapse.
_ADAM_SILOS = 100
_NATURAL_DAMPING = 0.5  # synchronous, natural solver (measured: docs/pvi.md)
# Local sigma points cost 2 n_L likelihood evaluations per global sigma point, and the
# local guide's steps then average over the 2 n_G global sigma points too (one draw
# before): item-response theory (n_G = 101, n_L = 1) took 12 s a round against 5.
# Beyond these sizes the default keeps Monte Carlo draws.
_QUADRATURE_MAX_LOCAL_DIM = 8
_QUADRATURE_MAX_GLOBAL_DIM = 50


class InvalidCavity(ValueError):
    """A silo's cavity :math:`q / t_m` is not a normalizable Gaussian, so its local
    free energy is undefined (Bui et al.'s non-log-concave hazard). ``state`` is the
    state before the offending round (a whole ``run`` without a progress bar: the
    run's first state), so nothing is lost."""

    def __init__(self, message: str, silo: int, state: Any) -> None:
        super().__init__(message)
        self.silo = silo
        self.state = state


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

    def __contains__(self, name: object) -> bool:
        # NumPyro's substitute asks ``name in params``; a tuple would answer False
        # and the guide would silently draw from its initial values (issue 21).
        raise TypeError(
            "PVIParams is not a dict of NumPyro parameters: pass "
            "pvi.pooled_params(params, data) to Predictive, with guide=pvi.guide."
        )


def _resolve_guide(model: Callable, guide: Any) -> AutoGlobalLocalNormal:
    if guide is None:
        return AutoMeanField(model)
    if isinstance(guide, AutoGlobalLocalNormal):
        return guide
    if isinstance(guide, (autoguide.AutoNormal, autoguide.AutoDiagonalNormal)):
        return AutoMeanField(model, init_loc_fn=guide.init_loc_fn)
    if isinstance(guide, autoguide.AutoMultivariateNormal):
        return AutoGlobalLocalNormal(
            model, global_cov="full", coupling=False, init_loc_fn=guide.init_loc_fn
        )
    raise TypeError(
        f"PVI needs a variational family closed under factor division (mean-field or "
        f"full-rank Gaussian over the global sites); {type(guide).__name__} is not "
        "(low-rank, flow, Delta and Laplace guides have no natural-parameter algebra). "
        "Use nf.AutoMeanField(model), nf.AutoGlobalLocalNormal(model, global_cov='full'), "
        "AutoNormal or AutoMultivariateNormal."
    )


class PVI(Driver):
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
        :class:`~numpyro_fed.AutoGlobalLocalNormal` with ``global_cov="full"`` or
        ``"diag"``, or NumPyro's ``AutoNormal`` / ``AutoDiagonalNormal`` /
        ``AutoMultivariateNormal`` (mapped to these). Other families are not closed
        under factor division and are refused.
    :param local_optim: each silo's optax optimizer (default ``optax.adam(1e-2)``).
    :param int local_steps: local optimizer steps per round (or fixed-point
        iterations with ``local_solver="natural"``).
    :param float damping: :math:`\\rho \\in (0, 1]`, the fraction of its update each
        silo sends (1 = undamped; the paper's E.4 "damping factor" is
        :math:`1 - \\rho`). Default: 1, or if synchronous 1/2 with the natural
        solver, :math:`1/J` with Adam's noisy solves (measured: ``docs/pvi.md``).
    :param str schedule: ``"synchronous"`` (every silo from the same q: the
        ``"simulate"`` runtime), ``"sequential"`` (one silo after another: the
        ``"events"`` runtime) or ``"asynchronous"`` (one after another, each from a q
        up to ``max_staleness`` updates old: ``"events"`` with staleness).
    :param str runtime: run the schedule's rounds on another runtime instead, e.g.
        ``"sequential"`` (synchronous rounds, one silo at a time in Python).
    :param float max_rejected: stop when a silo's replies were rejected in more than
        this fraction of its rounds (see :class:`~numpyro_fed.infer.driver.Driver`).
    :param float participation: fraction of silos that take part in a round.
    :param int num_particles: Monte Carlo draws per local step (unused by the
        ``"natural"`` solver when ``local_quadrature`` is on).
    :param bool analytic_kl: closed-form KL to the cavity (lower variance).
    :param bool stl: sticking-the-landing gradients for Monte Carlo entropy terms.
    :param str local_solver: ``"natural"`` or ``"adam"``. ``"natural"``: the
        paper's damped fixed-point iteration (eq. 10) for q, with expectations at 2d
        sigma points (exact one-step updates for conjugate Gaussian likelihoods); a
        model's local guide takes ``local_guide_steps`` steps of ``local_optim`` per
        iteration under the current q. ``"adam"``: ``local_steps`` steps of
        ``local_optim`` on q and the local guide together. Default: ``"natural"``,
        except for a model without local latents given a ``local_optim`` (the
        optimizer is then the one for q). Adam's steps have a fixed size whatever a
        silo's share of the data: with many small silos under the sequential
        schedule they add up to a collapsed q (PVI warns); natural steps do not.
    :param str curvature: the ``"natural"`` solver's expected Hessian: ``"hessian"``
        averages the Hessians at the 2d sigma points (about :math:`2d^2` gradients);
        ``"stein"`` gets it from their gradients (:math:`2d`; ``docs/pvi.md``); default
        ``"auto"``: ``"hessian"`` up to 50 global coordinates, ``"stein"`` above.
    :param int local_guide_steps: ``local_solver="natural"``: ``local_optim`` steps of
        the local guide per iteration (1: radon's county effects lag q 50+ rounds).
    :param bool local_quadrature: ``local_solver="natural"``: expectations over each
        unit's local latents at the 2 :math:`n_L` sigma points of its noise (exact
        for a log density quadratic in them) instead of ``num_particles`` Monte Carlo
        draws, so that a silo's whole solve is deterministic. Default: on for
        local guides with ``local_cov`` ``"diag"`` or ``"full"``, :math:`n_L \\le 8`
        local coordinates per unit and :math:`n_G \\le 50` global ones (its cost grows
        with both). Monte Carlo local solves leave q jittering
        about, and biased from, central VI's optimum (``docs/pvi.md``).
    :param bool reset_optimizer: ``local_solver="adam"``: a fresh optimizer state each
        round (Adam's moments otherwise remember round 1's large gradients).
    :param hyper_optim: the server's optax optimizer for ``numpyro.param`` sites
        (default ``optax.adam(1e-2)``).
    :param int max_staleness: asynchronous schedule: the largest number of updates a
        silo's copy of q may lag behind (within a round).
    :param str order: ``"cyclic"`` or ``"random"`` visiting order for the sequential
        and asynchronous schedules.
    :param float average: the fraction of the last rounds whose q ``run`` averages
        (natural parameters) into ``params``: Monte Carlo local solves make q jitter
        about it (measured: ``docs/pvi.md``). 0: the last q (``state`` always
        holds it); a run from ``init_state`` averages its own rounds only.
    :param str init: ``"prior"`` (the paper's :math:`q^{(0)} = p`, all
        :math:`t_m = 1`) or ``"guide"`` (:math:`q^{(0)}` from the guide's
        ``init_loc_fn`` / ``init_scale``, split evenly across the factors; breaks the
        symmetry of neural-network weights).

    ``run`` returns a :class:`~numpyro_fed.RunResult` whose ``history`` holds ``q``
    (stacked :class:`~numpyro_fed.expfam.GaussianNat` at the end of each round) and
    the :class:`~numpyro_fed.algorithms.pvi_messages.PVIInfo` fields (with a leading event axis
    per round for the sequential and asynchronous schedules).

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

    description = "PVI rounds"

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
        local_solver: str | None = None,
        curvature: str = "auto",
        local_guide_steps: int = 10,
        local_quadrature: bool | None = None,
        reset_optimizer: bool = False,
        hyper_optim: optax.GradientTransformation | None = None,
        max_staleness: int = 2,
        order: str = "cyclic",
        init: str = "prior",
        runtime: str | None = None,
        max_rejected: float | None = 0.25,
        average: float = 0.5,
    ) -> None:
        if schedule not in _SCHEDULES:
            raise ValueError(
                f"schedule must be one of {tuple(_SCHEDULES)}, got {schedule!r}."
            )
        if damping is not None and not 0 < damping <= 1:
            raise ValueError(f"damping must be in (0, 1], got {damping!r}.")
        local_steps = check_count("local_steps", local_steps)
        num_particles = check_count("num_particles", num_particles)
        local_guide_steps = check_count("local_guide_steps", local_guide_steps)
        if local_solver not in (None, "adam", "natural"):
            raise ValueError(
                f"local_solver must be 'adam' or 'natural', got {local_solver!r}."
            )
        if curvature not in CURVATURES:
            raise ValueError(f"curvature must be one of {CURVATURES}, got {curvature!r}.")
        if init not in ("prior", "guide"):
            raise ValueError(f"init must be 'prior' or 'guide', got {init!r}.")
        if not 0 <= average < 1:
            raise ValueError(f"average must be in [0, 1), got {average!r}.")
        for name, opt in (("local_optim", local_optim), ("hyper_optim", hyper_optim)):
            if opt is not None:
                check_optimizer(name, opt)
        max_staleness = check_count("max_staleness", max_staleness, minimum=0)
        super().__init__(
            runtime=runtime or _SCHEDULES[schedule],
            participation=participation,
            order=order,
            max_staleness=max_staleness if schedule == "asynchronous" else 0,
            max_rejected=max_rejected,
        )
        self.model = model
        self.guide = _resolve_guide(model, guide)
        self.local_optim = local_optim or optax.adam(1e-2)
        self.hyper_optim = hyper_optim or optax.adam(1e-2)
        self.local_steps = local_steps
        self.damping = damping
        self.schedule = schedule
        self.num_particles = num_particles
        self.analytic_kl = analytic_kl
        self.stl = stl
        self.local_solver = local_solver
        self.curvature = curvature
        self.local_guide_steps = local_guide_steps
        self.local_quadrature = local_quadrature
        if local_quadrature and self.guide.local_cov == "silo":
            raise ValueError(
                "local_quadrature=True needs local latents independent across units; "
                "local_cov='silo' correlates them (use local_cov='diag' or 'full')."
            )
        self.reset_optimizer = reset_optimizer
        # The solver in use: local_solver, or (None) chosen at set-up, once the
        # model's local latent sites are known; an optimizer the user gave is one
        # they mean to be used.
        self.solver = local_solver
        self.explicit_optim = local_optim is not None
        self.init_from = init
        self.average = average
        self._priors: dict = {}

    def average_window(self, rounds: int) -> int:
        """How many of the last of ``rounds`` rounds' q ``run`` averages (≥ 1)."""
        return max(int(self.average * rounds), 1)

    def damping_for(self, num_silos: int) -> float:
        """The damping used with ``num_silos`` silos."""
        if self.damping is not None:
            return self.damping
        if self.schedule != "synchronous":
            return 1.0  # before set-up: the default solver for the optimizer given
        solver = self.solver or ("adam" if self.explicit_optim else "natural")
        return 1.0 / num_silos if solver == "adam" else _NATURAL_DAMPING

    def quadrature(self) -> bool:
        """Whether the local latents' expectations use sigma points (after set-up)."""
        if self.solver != "natural" or not self.guide.require_setup().local_sites:
            return False
        if self.local_quadrature is not None:
            return self.local_quadrature
        return (
            self.guide.local_cov != "silo"
            and self.guide.local_dim <= _QUADRATURE_MAX_LOCAL_DIM
            and self.guide.global_dim <= _QUADRATURE_MAX_GLOBAL_DIM
        )

    # ------------------------------------------------------------ driver hooks
    def _setup(self, data: Any) -> None:
        roles = self.guide.setup(data)
        self.guide.check_model(self.model, data)
        self._nested[self._layout(data)] = nested_sizes(self.model, data, roles)
        if not roles.global_sites:
            raise ValueError(
                "PVI approximates the posterior of global latent sites, and this model "
                "has none (every latent site is inside the silo plate "
                f"{roles.silo_plate!r}); fit each silo on its own instead."
            )
        if self.local_solver is None:
            self.solver = (
                "adam" if self.explicit_optim and not roles.local_sites else "natural"
            )
        if (
            self.solver == "adam"
            and self.schedule != "synchronous"
            and data.num_silos >= _ADAM_SILOS
        ):
            warnings.warn(
                f"PVI with local_solver='adam', the {self.schedule} schedule and "
                f"{data.num_silos} silos: Adam moves q by a fixed step whatever a "
                "silo's share of the data, and over this many silos those moves add "
                "up to a q that is too narrow (J = 2,000: sd 0.0014 against the "
                "exact 0.024). Use local_solver='natural'.",
                stacklevel=3,
            )
        template = data_template(data.silo(0))
        theta0 = {k: jnp.asarray(v) for k, (v, _) in self.guide.param_specs.items()}
        # A global numpyro.factor is a prior term that no site's distribution shows:
        # the prior is then not read off the sites but refined like a non-Gaussian one.
        self._priors[self._layout(data)] = (
            None
            if roles.factor_sites
            else (
                gaussian_prior(
                    self.model,
                    list(self.guide.global_specs),
                    template,
                    theta0,
                    self.guide.global_cov == "full",
                )
            )
        )

    def _options(self, data: Any) -> dict:
        """The arguments of :func:`~numpyro_fed.algorithms.pvi.pvi` for ``data``."""
        return dict(
            model=self.model,
            guide=self.guide,
            local_optim=self.local_optim,
            template=data_template(data.silo(0)),
            num_silos=data.num_silos,
            local_steps=self.local_steps,
            damping=self.damping_for(data.num_silos),
            prior_of=self._priors[self._layout(data)],
            hyper_optim=self.hyper_optim,
            num_particles=self.num_particles,
            analytic_kl=self.analytic_kl,
            stl=self.stl,
            local_solver=self.solver,
            curvature=self.curvature,
            local_guide_steps=self.local_guide_steps,
            local_quadrature=self.quadrature(),
            reset_optimizer=self.reset_optimizer,
            padded=min(data.sizes) < data.padded_size,
        )

    def _make_algorithm(self, data: Any):
        return pvi(**self._options(data))

    def _record(self, state: FederatedState) -> dict:
        return {"q": state.server.q}

    def _check_info(self, state: FederatedState, info: Any) -> None:
        bad = np.asarray(info.invalid_cavity).reshape(-1)
        bad = bad[bad >= 0]
        if bad.size:
            silo = int(bad[0])
            raise InvalidCavity(
                f"Silo {silo}'s cavity q / t_{silo} is not a valid Gaussian (its "
                "precision is not positive definite), so its local free energy is "
                "undefined. This happens with non-log-concave likelihoods and weak "
                "priors; use a stronger prior, more damping, or a sequential schedule.",
                silo,
                state,
            )

    # -------------------------------------------------------------- NumPyro API
    def init(
        self, rng_key: jax.Array, data: Any, *, init_params: Any = None
    ) -> FederatedState:
        """
        :param jax.random.key rng_key: random key.
        :param FederatedData data: the silos' data.
        :param init_params: not supported (PVI starts from its prior or its guide).
        :return: the initial state: :math:`q^{(0)} = p` and :math:`t_m = 1` (or the
            guide's initial q, see ``init``).
        """
        state = super().init(rng_key, data, init_params=init_params)
        if self.init_from == "prior":
            return state
        # q starts from the guide's initial q; the difference from the prior is split
        # evenly over the silos' factors, so that q = p prod t_m from the start.
        template = data_template(data.silo(0))
        eta = self.guide.init_global(jax.random.fold_in(rng_key, 2), template)
        start = from_loc_scale(eta["loc"], eta["scale"], eta.get("tril"))
        prior, num_silos = state.server.prior, data.num_silos
        share = start.minus(prior).times(1.0 / num_silos)
        factors = jax.tree.map(
            lambda x, old: jnp.broadcast_to(x, old.shape).astype(old.dtype),
            share,
            state.silos.factor,
        )
        q = jax.tree.map(
            lambda x, old: x.astype(old.dtype),
            prior.plus(share.times(float(num_silos))),
            state.server.q,
        )
        return state._replace(
            server=state.server._replace(q=q),
            silos=state.silos._replace(factor=factors),
        )

    def run(
        self, rng_key: jax.Array, num_steps: int, data: Any, **kwargs: Any
    ) -> RunResult:
        """:meth:`Driver.run <numpyro_fed.infer.driver.Driver.run>` (``num_steps``
        rounds), warning when the server had to shrink updates to keep q valid and
        when q has not settled at its fixed point by the end (see ``docs/pvi.md``).
        The returned ``params`` hold the average of the last rounds' q (see
        ``average``); ``state`` holds the last round's, to resume from."""
        result = super().run(rng_key, num_steps, data, **kwargs)
        window = self.average_window(len(result.losses))
        q = check_run(type(self).__name__, result, window)
        if window == 1:
            return result
        state = result.state._replace(server=result.state.server._replace(q=q))
        return result._replace(params=self.get_params(state))

    def get_params(self, state: FederatedState) -> PVIParams:
        """The constrained parameters of ``state``."""
        _, local_c = self.guide.param_constraints()
        return PVIParams(
            constrain(self.guide.theta_constraints(), state.server.theta),
            guide_params(state.server.q, self.guide.global_cov == "full"),
            local_params(local_c, state.silos),
        )

    def pooled_params(self, params: PVIParams, data: Any) -> dict[str, jax.Array]:
        """``params`` under the names and pooled layout of :attr:`guide` (what PVI
        fits, also when given ``AutoNormal``): ``Predictive(model, guide=pvi.guide,
        params=pvi.pooled_params(result.params, data))`` draws from the fitted q."""
        return pooled_guide_params(params, data)

    def refines_prior(self, data: Any) -> bool:
        """Whether the server refines a factor :math:`t_0` for the prior (the prior
        of the global sites is not Gaussian in unconstrained space) for ``data``."""
        self._build(data)
        return self._priors[self._layout(data)] is None

    def factors(self, state: FederatedState) -> GaussianNat:
        """Every silo's factor :math:`t_m` as the server has applied it (stacked): the
        committed factor plus the pending update times the server's acknowledgement,
        which the silo commits at its next step."""
        ack = state.server.ack
        return jax.tree.map(
            lambda t, d: t + d * ack.reshape((-1,) + (1,) * (t.ndim - 1)),
            state.silos.factor,
            state.silos.pending,
        )

    def factor_sum(self, state: FederatedState) -> GaussianNat:
        """:math:`\\eta_0 + \\sum_m \\eta_m` recomputed from the silos' factors (equals
        ``state.server.q`` at every round: the paper's Property 2)."""
        total = jax.tree.map(lambda x: jnp.sum(x, 0), self.factors(state))
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
