# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""PVI: partitioned variational inference (Bui et al.), as pure functions.

The posterior over the flat unconstrained global vector :math:`u` is
:math:`q(u) = p(u) \\prod_m t_m(u)` with Gaussian factors in natural parameters
(:mod:`numpyro_fed.expfam`). Silo :math:`m` receives :math:`q`, forms its cavity
:math:`q^{\\backslash m} = q / t_m`, maximizes its local free energy

.. math::

    F_m(q) = E_q[\\log p(y_m, z_m \\mid u) - \\log q(z_m)] - KL(q \\| q^{\\backslash m})

(the ordinary ELBO on its own data with the cavity as prior; local latents
:math:`z_m` keep their own guide, which never leaves the silo), and sends only
:math:`\\Delta\\eta_m = \\rho(\\eta_{q}^{new} - \\eta_q)`. The server adds what it
receives, shrinking the step until :math:`q` stays a valid Gaussian, and acknowledges
the applied fraction so that every silo's factor stays in step with the server
(:math:`\\eta_q = \\eta_0 + \\sum_m \\eta_m` at every round, the paper's Property 2).

When the prior is not Gaussian in unconstrained space (a ``HalfNormal`` scale, a
hierarchical prior), the server keeps an in-family factor :math:`t_0` for it and
refines it like any silo factor, with the prior (and the log-Jacobian of the transform)
as its "likelihood" (Bui et al., Appendix B.2); its fixed point is then global VI in the
same family.
"""

from typing import Any, Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpy as np
import optax

from numpyro_fed.algorithms.sfvi import noise_keys
from numpyro_fed.densities import server_log_density, silo_log_density
from numpyro_fed.expfam import (
    GaussianNat,
    expected_log_factor,
    from_loc_scale,
    is_valid,
    kl,
    log_density,
    to_loc_scale,
    to_moments,
)
from numpyro_fed.protocol import SiloData
from numpyro_fed.util import all_finite, constrain, unconstrain

__all__ = [
    "PVIFunctions",
    "PVIInfo",
    "PVIServerMessage",
    "PVIServerState",
    "PVISiloMessage",
    "PVISiloState",
    "apply_update",
    "pvi",
]

_LOG_2PI_E = float(np.log(2 * np.pi) + 1.0)


class PVISiloState(NamedTuple):
    """Everything a silo keeps (none of it leaves the silo).

    - **factor** - its approximate likelihood factor :math:`t_m` (natural parameters).
    - **eta_local** - unconstrained parameters of its local guide (units first).
    - **optim_state** - its optimizer's state over (global q, local guide).
    - **rng_key** - its own key chain for Monte Carlo noise.
    """

    factor: GaussianNat
    eta_local: dict
    optim_state: Any
    rng_key: jax.Array


class PVIServerState(NamedTuple):
    """- **q** - the authoritative posterior :math:`\\eta_q` over the global vector.
    - **prior** - :math:`\\eta_0`: the exact Gaussian prior, or the refined factor
      :math:`t_0` standing for a non-Gaussian one.
    - **theta** - unconstrained model parameters (``numpyro.param`` sites).
    - **optim_state** - the server optimizer's state over ``theta``.
    - **prior_silo** - the state of the :math:`t_0` refinement (``None`` with an exact
      Gaussian prior).
    - **stale** - the asynchronous schedule's recent versions of :math:`q`, newest
      first (``None`` for the other schedules).
    """

    q: GaussianNat
    prior: GaussianNat
    theta: dict
    optim_state: Any
    prior_silo: PVISiloState | None
    stale: GaussianNat | None


class PVIServerMessage(NamedTuple):
    """Server -> silo: the current posterior and model parameters.

    - **q** - :math:`\\eta_q` (Fed-GVI: the server's GVI posterior :math:`q_s`).
    - **theta** - unconstrained model parameters.
    - **aggregate** - Fed-GVI only: :math:`\\sum_k \\eta_k`, the silos' factors
      summed (never an individual one); ``None`` for PVI.
    """

    q: GaussianNat
    theta: dict
    aggregate: GaussianNat | None = None


class PVISiloMessage(NamedTuple):
    """Silo -> server.

    - **delta** - :math:`\\Delta\\eta_m`, the damped change of the silo's factor.
    - **grad_theta** - gradient of the silo's expected log-likelihood w.r.t. the
      unconstrained model parameters at the received :math:`q` (Bui et al., eq. 5).
    - **elbo** - the silo's term :math:`E_q[\\log p(y_m, z_m \\mid u) - \\log q(z_m)]`
      at the received :math:`q`, for the global free energy.
    - **valid_cavity** - whether the silo's cavity was a valid Gaussian; if not, the
      silo did not update and ``delta`` is zero.
    """

    delta: GaussianNat
    grad_theta: dict
    elbo: jax.Array
    valid_cavity: jax.Array


class PVIInfo(NamedTuple):
    """- **elbo** - the global free energy estimate: the silos' terms, each at the
      :math:`q` it received, plus the server's :math:`-KL(q \\| p)` at the round's
      start.
    - **scale** - the smallest fraction of a proposed update the server applied
      (< 1 when it had to shrink a step to keep :math:`q` valid).
    - **num_rejected** - silo updates dropped because they were not finite.
    - **invalid_cavity** - index of a silo whose cavity was not a valid Gaussian, or -1.
    """

    elbo: jax.Array
    scale: jax.Array
    num_rejected: jax.Array
    invalid_cavity: jax.Array


class PVIFunctions(NamedTuple):
    """PVI's pure functions (built by :func:`pvi`).

    - **init_silo** - ``(key, silo_data, q) -> PVISiloState``.
    - **init_prior_silo** - ``(key) -> PVISiloState`` for :math:`t_0` (or ``None``).
    - **silo_step** - ``(message, silo_state, silo_data) -> (reply, silo_state)``:
      the silo's local optimization; its factor is not changed yet.
    - **prior_step** - the server's own step on :math:`t_0`, same signature (data
      ignored), or ``None``.
    - **server_elbo** - ``(q, theta, key) -> (value, grad_theta)``: the server's
      term :math:`E_q[\\log p(u)] + H(q)` (exact: :math:`-KL(q\\|p)`).
    - **prior_of** - ``(unconstrained theta) -> GaussianNat``: the exact prior, or
      ``None``.
    - **to_guide** / **from_guide** - conversions between :math:`\\eta_q` and the
      guide's constrained global parameters.
    - **message_of** - ``(q, prior, theta) -> PVIServerMessage``: what the server
      sends when its authoritative natural parameters are ``q``.
    """

    init_silo: Callable
    init_prior_silo: Callable | None
    silo_step: Callable
    prior_step: Callable | None
    server_elbo: Callable
    prior_of: Callable | None
    to_guide: Callable
    from_guide: Callable
    message_of: Callable


def apply_update(q: GaussianNat, delta: GaussianNat, max_halvings: int = 30):
    """:math:`\\eta_q + s\\,\\Delta\\eta` with the largest :math:`s \\in \\{1, \\frac12,
    \\frac14, \\dots\\}` that keeps :math:`q` a valid Gaussian (the valid set is convex
    and open and contains :math:`\\eta_q`, so halving terminates); :math:`s = 0` if
    none of ``max_halvings`` halvings does.

    :return: ``(new_q, s)``.
    """

    def invalid(s):
        return ~is_valid(q.plus(delta.times(s)))

    def cond(carry):
        s, k = carry
        return invalid(s) & (k < max_halvings)

    s, _ = lax.while_loop(
        cond, lambda c: (0.5 * c[0], c[1] + 1), (jnp.ones((), q.h.dtype), 0)
    )
    s = jnp.where(invalid(s), 0.0, s)
    return q.plus(delta.times(s)), s


def _select(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _sigma_points(q: GaussianNat) -> jax.Array:
    """The 2d symmetric sigma points of q: exact expectations of polynomials of degree
    up to 3, so of the gradient and Hessian of a quadratic log-likelihood."""
    mean, cov = to_moments(q)
    d = mean.shape[0]
    root = jnp.linalg.cholesky(cov) if cov.ndim == 2 else jnp.diag(jnp.sqrt(cov))
    offsets = jnp.sqrt(d) * root.T
    return jnp.concatenate([mean + offsets, mean - offsets])


def pvi(
    model: Callable,
    guide: Any,
    local_optim: optax.GradientTransformation,
    template: dict,
    *,
    local_steps: int,
    damping: float,
    prior_of: Callable | None,
    num_particles: int = 1,
    analytic_kl: bool = True,
    stl: bool = True,
    local_solver: str = "adam",
    padded: bool = True,
    observed_fn: Callable | None = None,
    cavity_of: Callable | None = None,
    message_of: Callable | None = None,
    divergence: Callable | None = None,
) -> PVIFunctions:
    """
    Build PVI's pure functions.

    :param callable model: the federated model.
    :param guide: an :class:`~numpyro_fed.AutoStructured` guide, already set up; its
        global factor (``global_cov="diag"`` or ``"full"``) is the PVI family.
    :param local_optim: the silos' optax optimizer.
    :param dict template: data-free arrays shaped like one unit of silo data.
    :param int local_steps: optimizer steps (or fixed-point iterations) per round.
    :param float damping: :math:`\\rho \\in (0, 1]` (1 = undamped).
    :param callable prior_of: ``theta -> GaussianNat``, the exact Gaussian prior of the
        global vector, or ``None`` to approximate the prior by a refined factor.
    :param int num_particles: Monte Carlo draws per local step.
    :param bool analytic_kl: closed-form :math:`KL(q \\| q^{\\backslash m})`; otherwise
        a Monte Carlo estimate, as NumPyro's ``Trace_ELBO`` would compute it.
    :param bool stl: sticking-the-landing gradients for the Monte Carlo entropy terms.
    :param str local_solver: ``"adam"`` (``local_steps`` steps of ``local_optim`` on
        the local free energy) or ``"natural"`` (the paper's damped fixed-point
        iteration, eq. 10, with expectations at 2d sigma points: exact for conjugate
        Gaussian likelihoods; models without local latents only).
    :param bool padded: some silos carry padded units that must be masked out.
    :param callable observed_fn: a robust loss applied to each observation's
        log-likelihood (see :func:`~numpyro_fed.densities.silo_log_density`).
    :param callable cavity_of: ``(message, factor) -> cavity``; PVI's is
        :math:`q / t_m`.
    :param callable message_of: ``(q, prior, theta) -> message``; PVI's sends ``q``.
    :param callable divergence: ``(q, prior) -> D(q || prior)`` for the server's
        term; PVI's is the KL divergence.
    :rtype: PVIFunctions
    """
    plate = guide.roles.silo_plate
    theta_c = guide.theta_constraints()
    glob_c, local_c = guide.param_constraints()
    full = guide.global_cov == "full"
    dim = guide.global_dim
    stop = lax.stop_gradient if stl else (lambda x: x)

    def to_guide(q: GaussianNat) -> dict:
        loc, scale, tril = to_loc_scale(q)
        params = {"loc": loc, "scale": scale}
        if full:
            params["tril"] = tril
        return params

    def from_guide(params: dict) -> GaussianNat:
        return from_loc_scale(params["loc"], params["scale"], params.get("tril"))

    def entropy(eta_g: dict) -> jax.Array:
        return jnp.sum(jnp.log(eta_g["scale"])) + 0.5 * dim * _LOG_2PI_E

    # ------------------------------------------------------------ likelihoods
    def silo_lik(values: dict, data: SiloData) -> jax.Array:
        """log p(y_m, z_m | u, theta) (or its robust-loss version) at site values."""
        mask = data.mask if padded else None
        return silo_log_density(
            model, plate, data.arrays, mask, values, observed_fn=observed_fn
        )

    def silo_term(glob_u, eta_l_u, theta_u, key, data: SiloData):
        """One draw of log p(y_m, z_m | u) - log q(z_m | u) and the global draw."""
        theta = constrain(theta_c, theta_u)
        eta_g = constrain(glob_c, glob_u)
        z_g = guide.sample_global(eta_g, guide.global_noise(key))
        values, _ = guide.constrain_global(z_g)
        log_q = jnp.zeros(())
        if eta_l_u:
            eta_l = constrain(local_c, eta_l_u)
            z_l = guide.sample_local(
                eta_g, eta_l, z_g, guide.local_noise(key, data.unit_ids)
            )
            local_values, log_det = guide.constrain_local(z_l)
            values.update(local_values)
            terms = guide.log_q_local(stop(eta_g), stop(eta_l), z_g, z_l) - log_det
            if padded:
                terms = jnp.where(data.mask, terms, 0.0)
            log_q = jnp.sum(terms)
        return silo_lik({**values, **theta}, data) - log_q, z_g

    def prior_term(glob_u, eta_l_u, theta_u, key, data):
        """One draw of log p(u) = log p(T(u)) + log|det J(u)|: t_0's 'likelihood'."""
        del eta_l_u, data
        eta_g = constrain(glob_c, glob_u)
        z_g = guide.sample_global(eta_g, guide.global_noise(key))
        return log_lik_at(True, z_g, theta_u, None), z_g

    def log_lik_at(is_prior: bool, u, theta_u, data):
        """The (prior or silo) log-likelihood at a fixed global point u."""
        theta = constrain(theta_c, theta_u)
        values, log_det = guide.constrain_global(u)
        if is_prior:
            return server_log_density(model, plate, template, {**values, **theta}) + (
                log_det
            )
        return silo_lik({**values, **theta}, data)

    # ------------------------------------------------------ local free energy
    def make_step(is_prior: bool):
        term = prior_term if is_prior else silo_term

        def free_energy(params, theta_u, cavity, keys, data):
            glob_u, eta_l_u = params
            eta_g = constrain(glob_c, glob_u)

            def particle(key):
                value, z_g = term(glob_u, eta_l_u, theta_u, key, data)
                if analytic_kl:
                    return value
                log_q = guide.log_q_global(stop(eta_g), z_g)
                return value + log_density(cavity, z_g, normalized=False) - log_q

            value = jnp.mean(jax.vmap(particle)(keys))
            if analytic_kl:
                # -KL(q || cavity) up to the cavity's constant log-normalizer, which
                # is not needed (and not finite for t_0's improper cavity).
                q = from_guide(eta_g)
                value = value + expected_log_factor(cavity, q) + entropy(eta_g)
            return value

        def data_value(glob_u, eta_l_u, theta_u, keys, data):
            values = jax.vmap(lambda k: term(glob_u, eta_l_u, theta_u, k, data)[0])
            return jnp.mean(values(keys))

        data_grad = jax.value_and_grad(data_value, argnums=2)
        loss_grad = jax.value_and_grad(
            lambda *a: -free_energy(*a)  # optax minimizes
        )

        def adam_fit(message, state, data, cavity):
            params = (unconstrain(glob_c, to_guide(message.q)), state.eta_local)

            def one_step(carry, _):
                params, optim_state, key = carry
                key, step_key = jax.random.split(key)
                keys = noise_keys(step_key, num_particles)
                loss, grads = loss_grad(params, message.theta, cavity, keys, data)
                updates, new_optim = local_optim.update(grads, optim_state, params)
                new_params = optax.apply_updates(params, updates)
                ok = all_finite((loss, grads))
                kept = _select(ok, (new_params, new_optim), (params, optim_state))
                return (*kept, key), loss

            (params, optim_state, key), _ = lax.scan(
                one_step,
                (params, state.optim_state, state.rng_key),
                None,
                length=local_steps,
            )
            glob_u, eta_local = params
            q_new = from_guide(constrain(glob_c, glob_u))
            return q_new, state._replace(
                eta_local=eta_local, optim_state=optim_state, rng_key=key
            )

        def natural_fit(message, state, data, cavity):
            def loglik(u):
                return log_lik_at(is_prior, u, message.theta, data)

            def target(factor):
                q = cavity.plus(factor)
                points = _sigma_points(q)
                grad = jnp.mean(jax.vmap(jax.grad(loglik))(points), 0)
                hess = jnp.mean(jax.vmap(jax.hessian(loglik))(points), 0)
                mean = to_moments(q)[0]
                if full:
                    prec = -0.5 * (hess + hess.T)
                    return GaussianNat(grad + prec @ mean, prec)
                prec = -jnp.diagonal(hess)
                return GaussianNat(grad + prec * mean, prec)

            def iterate(factor, _):
                # A fixed-point step that would leave the local q invalid (a
                # non-log-concave likelihood seen through a wide q) is shortened.
                q, _ = apply_update(cavity.plus(factor), target(factor).minus(factor))
                return q.minus(cavity), None

            factor, _ = lax.scan(iterate, state.factor, None, length=local_steps)
            return cavity.plus(factor), state

        fit = natural_fit if local_solver == "natural" else adam_fit

        def step(message: PVIServerMessage, state: PVISiloState, data: SiloData):
            cavity = cavity_of(message, state.factor)
            # t_0's cavity (the silo factors alone) may be improper; its tilted
            # distribution, with the prior in it, is not.
            valid = jnp.array(True) if is_prior else is_valid(cavity)
            # The report draw folds in, so the local fit's key chain is the one a
            # centralized NumPyro SVI run would use.
            report_key = jax.random.fold_in(state.rng_key, 1)
            # The local fit starts from the q just received, never from a cached local
            # q: the latter amplifies inexact solves under synchronous updates.
            glob0 = unconstrain(glob_c, to_guide(message.q))
            report_keys = noise_keys(report_key, num_particles)
            if local_solver == "natural":
                points = _sigma_points(message.q)
                elbo, grad_theta = data_grad_at_points(points, message.theta, data)
            else:
                elbo, grad_theta = data_grad(
                    glob0, state.eta_local, message.theta, report_keys, data
                )
            q_new, new_state = fit(message, state, data, cavity)
            delta = q_new.minus(message.q).times(damping)
            ok = valid & all_finite((delta, elbo, grad_theta))
            # A non-finite reply goes to the server as it is: the server rejects and
            # counts it; the silo keeps its state.
            reply = PVISiloMessage(
                _select(valid, delta, jax.tree.map(jnp.zeros_like, delta)),
                grad_theta,
                elbo,
                valid,
            )
            return reply, _select(ok, new_state, state)

        def data_grad_at_points(points, theta_u, data):
            def value(theta_u):
                at = jax.vmap(lambda u: log_lik_at(is_prior, u, theta_u, data))
                return jnp.mean(at(points))

            return jax.value_and_grad(value)(theta_u)

        return step

    def init_state(key, eta_local, q0):
        glob_u = unconstrain(glob_c, to_guide(q0))
        zeros = GaussianNat.zeros(dim, full, q0.h.dtype)
        optim_state = local_optim.init((glob_u, eta_local))
        return PVISiloState(zeros, eta_local, optim_state, key)

    def init_silo(key: jax.Array, data: SiloData, q0: GaussianNat) -> PVISiloState:
        init_key, chain_key = jax.random.split(key)
        eta_local = unconstrain(local_c, guide.init_local(init_key, data.arrays))
        return init_state(chain_key, eta_local, q0)

    def init_prior_silo(key: jax.Array, q0: GaussianNat) -> PVISiloState:
        return init_state(key, {}, q0)

    prior_u = None
    if prior_of is not None:
        prior_u = lambda t: prior_of(constrain(theta_c, t))  # noqa: E731

    def server_elbo(q: GaussianNat, theta_u: dict, key: jax.Array):
        if prior_u is not None:
            return jax.value_and_grad(lambda t: -divergence(q, prior_u(t)))(theta_u)
        glob_u = unconstrain(glob_c, to_guide(q))
        keys = jax.random.split(key, max(num_particles, 1))

        def value(t):
            draws = jax.vmap(lambda k: prior_term(glob_u, {}, t, k, None)[0])(keys)
            return jnp.mean(draws) + entropy(to_guide(q))

        return jax.value_and_grad(value)(theta_u)

    if cavity_of is None:
        cavity_of = lambda message, factor: message.q.minus(factor)  # noqa: E731
    if message_of is None:
        message_of = lambda q, prior, theta: PVIServerMessage(q, theta)  # noqa: E731
    if divergence is None:
        divergence = kl
    silo_step = make_step(False)
    prior_step = None if prior_of is not None else make_step(True)
    return PVIFunctions(
        init_silo,
        None if prior_of is not None else init_prior_silo,
        silo_step,
        prior_step,
        server_elbo,
        prior_u,
        to_guide,
        from_guide,
        message_of,
    )
