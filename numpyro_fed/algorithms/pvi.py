# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""PVI: partitioned variational inference (Bui et al.), as a
:class:`~numpyro_fed.FederatedAlgorithm`.

The posterior over the flat unconstrained global vector :math:`u` is
:math:`q(u) = p(u) \\prod_m t_m(u)` with Gaussian factors in natural parameters
(:mod:`numpyro_fed.expfam`). Silo :math:`m` receives :math:`q`, forms its cavity
:math:`q^{\\backslash m} = q / t_m`, maximizes its local free energy

.. math::

    F_m(q) = E_q[\\log p(y_m, z_m \\mid u) - \\log q(z_m)] - KL(q \\| q^{\\backslash m})

(the ordinary ELBO on its own data with the cavity as prior; local latents
:math:`z_m` keep their own guide, which never leaves the silo), and sends only
:math:`\\Delta\\eta_m = \\rho(\\eta_{q}^{new} - \\eta_q)`. The server adds what it
receives, shrinking the step until :math:`q` stays a valid Gaussian, and records the
fraction :math:`s_m` it applied to each silo's update; the silo reads it in its row of
the next routed message and commits :math:`s_m \\Delta\\eta_m` before it steps again,
so :math:`\\eta_q = \\eta_0 + \\sum_m (\\eta_m + s_m \\Delta\\eta_m)` after every server
step (the paper's Property 2), under any runtime.

When the prior is not Gaussian in unconstrained space (a ``HalfNormal`` scale, a
hierarchical prior), the server keeps an in-family factor :math:`t_0` for it and
refines it at each server step like a silo factor, with the prior (and the log-Jacobian
of the transform) as its "likelihood" (Bui et al., App. B.2); its fixed point is then
global VI in the same family.
"""

from typing import Any, Callable

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from numpyro_fed.algorithms.pvi_messages import (
    Cavity,
    PVIInfo,
    PVIServerState,
    PVISiloMessage,
    PVISiloState,
    kl_cavity,
)
from numpyro_fed.densities import server_log_density, silo_log_density
from numpyro_fed.elbo import (
    GlobalDraw,
    draw_global,
    initial_globals,
    noise_keys,
    silo_terms,
)
from numpyro_fed.expfam import (
    GaussianNat,
    apply_update,
    expected_derivatives,
    expected_log_factor,
    from_loc_scale,
    guide_params,
    is_valid,
    line_search,
    log_density,
    prior_summary,
    sigma_points,
    standard_sigma_points,
    to_moments,
)
from numpyro_fed.guard import guard_nonfinite
from numpyro_fed.protocol import FederatedAlgorithm, Message, SiloData
from numpyro_fed.util import all_finite, ascent, constrain, tree_where, unconstrain

__all__ = ["pvi"]

_LOG_2PI_E = float(np.log(2 * np.pi) + 1.0)


def pvi(
    model: Callable,
    guide: Any,
    local_optim: optax.GradientTransformation,
    template: dict,
    *,
    num_silos: int,
    local_steps: int,
    damping: float,
    prior_of: Callable | None,
    hyper_optim: optax.GradientTransformation | None = None,
    num_particles: int = 1,
    analytic_kl: bool = True,
    stl: bool = True,
    local_solver: str = "adam",
    curvature: str = "auto",
    local_guide_steps: int = 1,
    reset_optimizer: bool = False,
    padded: bool = True,
    observed_fn: Callable | None = None,
    cavity: Cavity | None = None,
    local_quadrature: bool = False,
) -> FederatedAlgorithm:
    """
    Build PVI (Bui et al.) as a :class:`~numpyro_fed.FederatedAlgorithm`.

    Synchronous PVI is this algorithm under the vmapped simulation runtime; the
    sequential and asynchronous schedules are the events runtime with no staleness
    and with staleness. The silo's key argument is not used: a silo draws its noise
    from the key chain in its state.

    :param callable model: the federated model.
    :param guide: an :class:`~numpyro_fed.AutoGlobalLocalNormal` guide, already set up; its
        global factor (``global_cov="diag"`` or ``"full"``) is the PVI family.
    :param local_optim: the silos' optax optimizer.
    :param dict template: one unit of silo data (:func:`~numpyro_fed.densities.data_template`).
    :param int num_silos: :math:`J` (the server keeps one acknowledgement per silo).
    :param int local_steps: optimizer steps (or fixed-point iterations) per round.
    :param float damping: :math:`\\rho \\in (0, 1]` (1 = undamped).
    :param callable prior_of: ``theta -> GaussianNat`` (constrained ``theta``), the
        exact Gaussian prior of the global vector, or ``None`` to approximate the
        prior by a refined factor.
    :param hyper_optim: the server's optax optimizer for ``numpyro.param`` sites
        (default ``optax.adam(1e-2)``).
    :param int num_particles: Monte Carlo draws per local step.
    :param bool analytic_kl: closed-form :math:`KL(q \\| q^{\\backslash m})`; otherwise
        a Monte Carlo estimate, as NumPyro's ``Trace_ELBO`` would compute it.
    :param bool stl: sticking-the-landing gradients for the Monte Carlo entropy terms.
    :param str local_solver: ``"adam"`` (``local_steps`` steps of ``local_optim`` on
        the local free energy) or ``"natural"`` (the paper's damped fixed-point
        iteration, eq. 10, with expectations at 2d sigma points: exact for conjugate
        Gaussian likelihoods; a local guide takes one ``local_optim`` step per
        iteration, and the silo's likelihood at a global point is its bound over its
        local latents).
    :param str curvature: ``"natural"`` solver: ``"auto"``, ``"hessian"`` or ``"stein"``
        (d times cheaper), see :func:`~numpyro_fed.expfam.expected_derivatives`.
    :param int local_guide_steps: ``"natural"`` solver: ``local_optim`` steps of the
        local guide (if any) per fixed-point iteration.
    :param bool reset_optimizer: ``"adam"`` solver: a fresh optimizer state each round.
    :param bool padded: some silos carry padded units that must be masked out.
    :param callable observed_fn: a robust loss applied to each observation's
        log-likelihood (see :func:`~numpyro_fed.densities.silo_log_density`).
    :param Cavity cavity: what the server sends and how a silo forms its cavity
        (default :func:`kl_cavity`, PVI's :math:`q / t_m`).
    :param bool local_quadrature: ``"natural"`` solver: expectations over the local
        latents at the sigma points of each unit's local noise (every unit at once:
        units are conditionally independent, so each needs its own marginal only), in
        place of ``num_particles`` Monte Carlo draws; the local guide's steps then use
        the global sigma points too. Deterministic; not for ``local_cov="silo"``.
    :rtype: FederatedAlgorithm
    """
    plate = guide.roles.silo_plate
    theta_c = guide.theta_constraints()
    glob_c, local_c = guide.param_constraints()
    full = guide.global_cov == "full"
    dim = guide.global_dim
    stop = lax.stop_gradient if stl else (lambda x: x)
    hyper_optim = hyper_optim or optax.adam(1e-2)
    cavity = cavity or kl_cavity()
    dtype = jnp.result_type(float)

    to_guide = lambda q: guide_params(q, full)
    from_guide = lambda p: from_loc_scale(p["loc"], p["scale"], p.get("tril"))

    def entropy(eta_g: dict) -> jax.Array:
        return jnp.sum(jnp.log(eta_g["scale"])) + 0.5 * dim * _LOG_2PI_E

    # ------------------------------------------------------------ likelihoods
    def silo_lik(values: dict, data: SiloData) -> jax.Array:
        """log p(y_m, z_m | u, theta) (or its robust-loss version) at site values."""
        mask = data.mask if padded else None
        return silo_log_density(
            model, plate, data.arrays, mask, values,
            observed_fn=observed_fn, nested=data.nested,
        )  # fmt: skip

    def silo_term(glob_u, eta_l_u, theta_u, key, data: SiloData):
        """One draw of log p(y_m, z_m | u) - log q(z_m | u) and the global draw."""
        eta_g = constrain(glob_c, glob_u)
        draw = draw_global(guide, eta_g, guide.global_noise(key))
        terms = silo_terms(
            model,
            guide,
            draw,
            constrain(theta_c, theta_u),
            eta_g,
            constrain(local_c, eta_l_u),
            key,
            data,
            stop=stop,
            padded=padded,
            observed_fn=observed_fn,
        )
        return terms.log_p - terms.log_q, draw.z

    def prior_term(glob_u, eta_l_u, theta_u, key, data):
        """One draw of log p(u) = log p(T(u)) + log|det J(u)|: t_0's 'likelihood'."""
        del eta_l_u, data
        eta_g = constrain(glob_c, glob_u)
        z_g = guide.sample_global(eta_g, guide.global_noise(key))
        return log_lik_at(True, z_g, theta_u, None), z_g

    def local_noises(keys, data: SiloData) -> jax.Array:
        """The local latents' standard noise to average over, ``(points, units,
        local_dim)``: one draw per key, or the sigma points (``local_quadrature``)."""
        if not local_quadrature:
            return jax.vmap(lambda k: guide.local_noise(k, data.unit_ids))(keys)
        points = standard_sigma_points(guide.local_dim, dtype)
        shape = (points.shape[0], data.unit_ids.shape[0], guide.local_dim)
        return jnp.broadcast_to(points[:, None, :], shape)

    def log_lik_at(
        is_prior: bool, u, theta_u, data, eta_g=None, eta_l_u=None, noises=None
    ):
        """The (prior or silo) log-likelihood at a fixed global point u. With local
        latents it is the silo's bound :math:`E_{q(z_m|u)}[\\log p(y_m, z_m \\mid u)
        - \\log q(z_m \\mid u)]`, averaged over the local ``noises``."""
        theta = constrain(theta_c, theta_u)
        values, log_det = guide.constrain_global(u)
        if is_prior:
            prior = server_log_density(model, plate, template, {**values, **theta})
            return prior + log_det
        if not eta_l_u:
            return silo_lik({**values, **theta}, data)
        draw = GlobalDraw(u, values, log_det)
        eta_l = constrain(local_c, eta_l_u)

        def one(noise):
            terms = silo_terms(
                model, guide, draw, theta, eta_g, eta_l, None, data,
                stop=stop, padded=padded, observed_fn=observed_fn, noise=noise,
            )  # fmt: skip
            return terms.log_p - terms.log_q

        return jnp.mean(jax.vmap(one)(noises))

    # ------------------------------------------------------ local free energy
    def make_step(is_prior: bool):
        term = prior_term if is_prior else silo_term

        def free_energy(params, theta_u, cav, keys, data):
            glob_u, eta_l_u = params
            eta_g = constrain(glob_c, glob_u)

            def particle(key):
                value, z_g = term(glob_u, eta_l_u, theta_u, key, data)
                if analytic_kl:
                    return value
                log_q = guide.log_q_global(stop(eta_g), z_g)
                return value + log_density(cav, z_g, normalized=False) - log_q

            value = jnp.mean(jax.vmap(particle)(keys))
            if analytic_kl:
                # -KL(q || cavity) up to the cavity's constant log-normalizer, which
                # is not needed (and not finite for t_0's improper cavity).
                q = from_guide(eta_g)
                value = value + expected_log_factor(cav, q) + entropy(eta_g)
            return value

        def data_value(glob_u, eta_l_u, theta_u, keys, data):
            values = jax.vmap(lambda k: term(glob_u, eta_l_u, theta_u, k, data)[0])
            return jnp.mean(values(keys))

        data_grad = jax.value_and_grad(data_value, argnums=2)
        loss_grad = jax.value_and_grad(
            lambda *a: -free_energy(*a)  # optax minimizes
        )

        def adam_fit(message, state, data, cav):
            params = (unconstrain(glob_c, to_guide(message.q)), state.eta_local)

            def one_step(carry, _):
                params, optim_state, key = carry
                key, step_key = jax.random.split(key)
                keys = noise_keys(step_key, num_particles)
                loss, grads = loss_grad(params, message.theta, cav, keys, data)
                updates, new_optim = local_optim.update(grads, optim_state, params)
                new_params = optax.apply_updates(params, updates)
                ok = all_finite((loss, grads))
                kept = tree_where(ok, (new_params, new_optim), (params, optim_state))
                return (*kept, key), loss

            (params, optim_state, key), _ = lax.scan(
                one_step,
                # Adam's moments from earlier rounds describe another q (issue 20).
                (params, local_optim.init(params), state.rng_key)
                if reset_optimizer
                else (params, state.optim_state, state.rng_key),
                None,
                length=local_steps,
            )
            glob_u, eta_local = params
            q_new = from_guide(constrain(glob_c, glob_u))
            return q_new, state._replace(
                eta_local=eta_local, optim_state=optim_state, rng_key=key
            )

        local_grad = jax.grad(data_value, argnums=1)  # d/d eta_local

        def natural_fit(message, state, data, cav):
            # Each iteration moves the local guide (if any) one optimizer step on the
            # silo's bound under the current q, then takes q's damped fixed-point step
            # with the local guide held: both steps are the silo's own size, so many
            # small silos do not add up fixed-size errors (Adam's do).
            def expected_loglik(q, eta_l_u, noises):
                eta_g = to_guide(q)
                at = lambda u: log_lik_at(
                    is_prior, u, message.theta, data, eta_g, eta_l_u, noises
                )
                return jnp.mean(jax.vmap(at)(sigma_points(q)))

            def target(factor, eta_l_u, noises):
                q = cav.plus(factor)
                eta_g = lax.stop_gradient(to_guide(q))

                def loglik(u):
                    return log_lik_at(
                        is_prior, u, message.theta, data, eta_g, eta_l_u, noises
                    )

                grad, hess = expected_derivatives(loglik, q, curvature)
                mean = to_moments(q)[0]
                if full:
                    prec = -0.5 * (hess + hess.T)
                    return GaussianNat(grad + prec @ mean, prec)
                prec = -jnp.diagonal(hess)
                # A mean step through the diagonal alone is a Jacobi iteration that
                # diverges on correlated inputs (German credit: 41 sds off): Newton's
                # with the whole Hessian, Jacobi's where the tilted one is not PD.
                resid = grad + cav.h - cav.prec * mean
                tilted = jnp.diag(cav.prec) - 0.5 * (hess + hess.T)
                newton = jax.scipy.linalg.cho_solve(
                    (jnp.linalg.cholesky(tilted), True), resid
                )
                jacobi = resid / (cav.prec + prec)
                step = jnp.where(jnp.all(jnp.isfinite(newton)), newton, jacobi)
                return GaussianNat(
                    grad + prec * mean + (cav.prec + prec) * (step - jacobi), prec
                )

            def local_value(q, eta_l_u, noises):
                expected = expected_loglik(q, eta_l_u, noises)
                return expected + expected_log_factor(cav, q) + entropy(to_guide(q))

            # The local guide's objective at the global sigma points (quadrature).
            sigma_grad = jax.grad(
                lambda eta_l_u, q, noises: expected_loglik(
                    lax.stop_gradient(q), eta_l_u, noises
                )
            )

            def iterate(carry, _):
                factor, eta_l_u, optim_state, key = carry
                key, step_key = jax.random.split(key)
                keys = noise_keys(step_key, num_particles)
                noises = local_noises(keys, data) if eta_l_u else None
                if eta_l_u:
                    glob_u = unconstrain(glob_c, to_guide(cav.plus(factor)))

                    def guide_step(carry, guide_keys):
                        eta_l_u, optim_state = carry
                        grads = (
                            sigma_grad(eta_l_u, cav.plus(factor), noises)
                            if local_quadrature
                            else local_grad(
                                glob_u, eta_l_u, message.theta, guide_keys, data
                            )
                        )
                        new_eta, new_optim = ascent(
                            local_optim, grads, optim_state, eta_l_u
                        )
                        ok = all_finite((grads, new_eta))
                        return tree_where(
                            ok, (new_eta, new_optim), (eta_l_u, optim_state)
                        ), None

                    # q's step is exact and the local guide's is a small first-order
                    # one, so the guide takes several per iteration (radon: with one,
                    # the county effects lag q for 50+ rounds).
                    guide_keys = (
                        keys[None]
                        if local_guide_steps == 1
                        else jax.vmap(lambda k: noise_keys(k, num_particles))(
                            jax.random.split(
                                jax.random.fold_in(step_key, 2), local_guide_steps
                            )
                        )
                    )
                    (eta_l_u, optim_state), _ = lax.scan(
                        guide_step, (eta_l_u, optim_state), guide_keys
                    )
                # Shortened until the local q is valid and the free energy has not
                # fallen: a Newton step through a wide q overshoots on log-scales
                # (radon: precisions of 1e140 after a round, then InvalidCavity).
                step = target(factor, eta_l_u, noises).minus(factor)
                value = lambda q: local_value(q, eta_l_u, noises)
                q = line_search(cav.plus(factor), step, value)
                return (q.minus(cav), eta_l_u, optim_state, key), None

            carry = (state.factor, state.eta_local, state.optim_state, state.rng_key)
            (factor, eta_local, optim_state, key), _ = lax.scan(
                iterate, carry, None, length=local_steps
            )
            return cav.plus(factor), state._replace(
                eta_local=eta_local, optim_state=optim_state, rng_key=key
            )

        fit = natural_fit if local_solver == "natural" else adam_fit

        def data_grad_at_points(q, theta_u, eta_l_u, keys, data):
            points = sigma_points(q)
            eta_g = to_guide(q)
            noises = local_noises(keys, data) if eta_l_u else None

            def value(theta_u):
                at = lambda u: log_lik_at(
                    is_prior, u, theta_u, data, eta_g, eta_l_u, noises
                )
                return jnp.mean(jax.vmap(at)(points))

            return jax.value_and_grad(value)(theta_u)

        def step(message, state: PVISiloState, data: SiloData):
            """The local fit from a committed factor: ``(reply, state)`` with the
            reply's update pending in the state."""
            cav = cavity.of(message, state.factor)
            # t_0's cavity (the silo factors alone) may be improper; its tilted
            # distribution, with the prior in it, is not.
            valid = jnp.array(True) if is_prior else is_valid(cav)
            # The report draw folds in, so the local fit's key chain is the one a
            # centralized NumPyro SVI run would use.
            report_key = jax.random.fold_in(state.rng_key, 1)
            # The local fit starts from the q just received, never from a cached local
            # q: the latter amplifies inexact solves under synchronous updates.
            glob0 = unconstrain(glob_c, to_guide(message.q))
            report_keys = noise_keys(report_key, num_particles)
            if local_solver == "natural":
                elbo, grad_theta = data_grad_at_points(
                    message.q, message.theta, state.eta_local, report_keys, data
                )
            else:
                elbo, grad_theta = data_grad(
                    glob0, state.eta_local, message.theta, report_keys, data
                )
            q_new, new_state = fit(message, state, data, cav)
            delta = q_new.minus(message.q).times(damping)
            zeros = jax.tree.map(jnp.zeros_like, delta)
            # An invalid cavity is reported (the server acknowledges 0) and the silo
            # keeps its state; a non-finite reply is the non-finite guard's to reject.
            reply = PVISiloMessage(
                tree_where(valid, delta, zeros), grad_theta, elbo, valid
            )
            new_state = tree_where(valid, new_state, state)
            return reply, new_state._replace(pending=tree_where(valid, delta, zeros))

        return step

    local_step = make_step(False)
    prior_step = make_step(True)
    refine_prior = prior_of is None

    def prior_u(theta_u: dict) -> GaussianNat:
        """The exact prior at unconstrained ``theta_u`` (only with ``prior_of``)."""
        if prior_of is None:
            raise ValueError("pvi: the prior is refined (prior_of=None), not exact")
        return prior_of(constrain(theta_c, theta_u))

    # ---------------------------------------------------------------- the silo
    def optim_init(eta_local: dict) -> Any:
        if local_solver == "natural":  # the optimizer moves the local guide only
            return local_optim.init(eta_local)
        # Any valid global parameters of the right shapes: optax's states depend on
        # shapes only for the optimizers PVI is used with.
        glob = {"loc": jnp.zeros(dim, dtype), "scale": jnp.ones(dim, dtype)}
        if full:
            glob["tril"] = jnp.zeros((dim, dim), dtype)
        return local_optim.init((unconstrain(glob_c, glob), eta_local))

    zero_factor = lambda: GaussianNat.zeros(dim, full, dtype)

    def init_silo(key: jax.Array, data: SiloData) -> PVISiloState:
        init_key, chain_key = jax.random.split(key)
        eta_local = unconstrain(local_c, guide.init_local(init_key, data.arrays))
        return PVISiloState(
            zero_factor(), zero_factor(), eta_local, optim_init(eta_local), chain_key
        )

    def silo_step(message: Message, state: PVISiloState, data: SiloData, key):
        del key  # the silo's noise comes from the key chain in its state
        factor = state.factor.plus(state.pending.times(message.routed))
        state = state._replace(factor=factor, pending=zero_factor())
        return local_step(message.broadcast, state, data)

    # -------------------------------------------------------------- the server
    def init_server(key: jax.Array) -> PVIServerState:
        theta, _ = initial_globals(guide, key, template)
        if refine_prior:
            supports = {n: spec.support for n, spec in guide.global_specs.items()}
            theta_0 = constrain(theta_c, theta)
            prior = prior_summary(model, supports, template, theta_0, key, full)
        else:
            prior = prior_u(theta)
        prior = jax.tree.map(lambda x: jnp.asarray(x, dtype), prior)
        return PVIServerState(
            prior,
            prior,
            theta,
            hyper_optim.init(theta),
            jnp.zeros((num_silos,), dtype),
            optim_init({}),
            jax.random.fold_in(key, 1),
        )

    def server_message(state: PVIServerState, key: jax.Array) -> Message:
        del key
        return Message(cavity.message(state.q, state.prior, state.theta), state.ack)

    def server_elbo(q: GaussianNat, theta_u: dict, key: jax.Array):
        """The server's term E_q[log p(u)] + H(q) (exact prior: -D(q || p)) and its
        gradient in theta."""
        if not refine_prior:
            minus_divergence = lambda t: -cavity.divergence(q, prior_u(t))
            return jax.value_and_grad(minus_divergence)(theta_u)
        glob_u = unconstrain(glob_c, to_guide(q))
        keys = jax.random.split(key, max(num_particles, 1))

        def value(t):
            draws = jax.vmap(lambda k: prior_term(glob_u, {}, t, k, None)[0])(keys)
            return jnp.mean(draws) + entropy(to_guide(q))

        return jax.value_and_grad(value)(theta_u)

    def server_step(
        state: PVIServerState, replies: PVISiloMessage, key, participating
    ) -> tuple[PVIServerState, PVIInfo]:
        message = cavity.message(state.q, state.prior, state.theta)
        used = participating & replies.valid_cavity

        def used_sum(x):
            rows = used.reshape((-1,) + (1,) * (x.ndim - 1))
            return jnp.sum(jnp.where(rows, x, 0), 0)

        total = jax.tree.map(used_sum, replies.delta)
        if refine_prior:
            # t_0 moves with the silos, from the same q.
            t0 = PVISiloState(
                state.prior, zero_factor(), {}, state.prior_optim, state.prior_key
            )
            reply0, t0 = prior_step(message, t0, None)
            ok0 = all_finite(reply0.delta)
            delta0 = tree_where(ok0, reply0.delta, zero_factor())
            total = total.plus(delta0)
        q, scale = apply_update(state.q, total)
        ack = jnp.where(participating, jnp.where(used, scale, 0.0), state.ack)
        state = state._replace(q=q, ack=ack.astype(state.ack.dtype))
        if refine_prior:
            state = state._replace(
                prior=state.prior.plus(delta0.times(scale)),
                prior_optim=t0.optim_state,
                prior_key=t0.rng_key,
            )
        # Bui et al., eq. 5: the silos' gradients (scaled up when only some
        # contributed, as the free energy estimate is) plus the server's term.
        count = jnp.maximum(jnp.sum(used), 1)
        weight = used.shape[0] / count
        server_value, server_grad = server_elbo(message.q, state.theta, key)
        if state.theta:
            grads = jax.tree.map(
                lambda g, g0: weight * used_sum(g) + g0, replies.grad_theta, server_grad
            )
            theta, optim_state = ascent(
                hyper_optim, grads, state.optim_state, state.theta
            )
            ok = all_finite(theta) & jnp.any(used)  # the prior alone moves nothing
            new = state._replace(theta=theta, optim_state=optim_state)
            if not refine_prior:
                # An exact prior that depends on theta moves q with it (q = p prod t_m).
                new_prior = prior_u(theta)
                new = new._replace(
                    q=state.q.plus(new_prior.minus(state.prior)), prior=new_prior
                )
                ok = ok & is_valid(new.q)
            state = tree_where(ok, new, state)
        elbo = server_value + weight * jnp.sum(jnp.where(used, replies.elbo, 0.0))
        invalid = participating & ~replies.valid_cavity
        info = PVIInfo(
            -elbo,
            participating & ~replies.valid_cavity,
            jnp.where(jnp.any(participating), scale, 1.0),
            jnp.where(jnp.any(invalid), jnp.argmax(invalid), -1),
        )
        return state, info

    return guard_nonfinite(
        FederatedAlgorithm(
            init_server, init_silo, server_message, silo_step, server_step
        )
    )
