# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""SFVI-Avg(m): federated averaging for structured VI (Hassan et al., Algorithm 2).

Each round the server sends :math:`(\\theta, \\eta_G)`; every silo runs ``m`` local
STL steps on its surrogate ELBO, in which its likelihood and local prior are scaled by
:math:`N / N_j` so that the surrogate has the scale of the full joint,

.. math::

    \\log p_\\theta(z_G) + \\frac{N}{N_j} \\log p_\\theta(y_j, z_{L_j} \\mid z_G)
    - \\log q_{\\eta_G}(z_G) - s \\log q_{\\eta_{L_j}}(z_{L_j} \\mid z_G),

with :math:`s = N/N_j` (``scale_local_entropy=True``, the local factor then targets
the untempered local conditional) or :math:`s = 1` (the paper's literal text, spec
§3.6). It returns only its :math:`(\\theta_j, \\eta_{G,j})`. The server averages
:math:`\\theta` and replaces :math:`q(z_G)` by the 2-Wasserstein barycenter of the
silos' global Gaussians (closed form when diagonal; for full covariances our
fixed point or ott-jax's, ``barycenter=``). Averaging happens in distribution space,
not parameter space.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from numpyro_fed.aggregate import (
    cov_to_scale_tril,
    scale_tril_to_cov,
    w2_barycenter_diag,
    w2_barycenter_fn,
    weighted_mean,
)
from numpyro_fed.algorithms.sfvi import SFVIInfo
from numpyro_fed.elbo import draw_global, initial_globals, server_terms, silo_terms
from numpyro_fed.families.gaussian import unit_tril
from numpyro_fed.guard import guard_nonfinite
from numpyro_fed.protocol import FederatedAlgorithm, Message, SiloData
from numpyro_fed.util import ascent, constrain, tree_where, unconstrain

__all__ = [
    "SFVIAvgServerMessage",
    "SFVIAvgServerState",
    "SFVIAvgSiloMessage",
    "SFVIAvgSiloState",
    "sfvi_avg",
]


class SFVIAvgServerState(NamedTuple):
    """- **theta** - unconstrained :math:`\\theta`.
    - **eta_global** - unconstrained :math:`\\eta_G`.
    """

    theta: dict
    eta_global: dict


class SFVIAvgSiloState(NamedTuple):
    """- **eta_local** - unconstrained local parameters (never leave the silo).
    - **optim_state** - optimizer state of the local parameters.
    - **global_optim_state** - optimizer state of the silo's copy of
      :math:`(\\theta, \\eta_G)`, carried across rounds or reset each round.
    """

    eta_local: dict
    optim_state: Any
    global_optim_state: Any


class SFVIAvgServerMessage(NamedTuple):
    """Server -> silos: unconstrained ``theta`` and ``eta_global``."""

    theta: dict
    eta_global: dict


class SFVIAvgSiloMessage(NamedTuple):
    """Silo -> server.

    - **theta**, **eta_global** - the silo's locally updated copies (unconstrained).
    - **elbo** - its surrogate ELBO at the last local step (for the loss trace).
    - **num_units** - :math:`N_j`, which the algorithm needs anyway to form :math:`N`.
    """

    theta: dict
    eta_global: dict
    elbo: jax.Array
    num_units: jax.Array


def sfvi_avg(
    model: Callable,
    guide: Any,
    optimizer: optax.GradientTransformation,
    template: dict,
    num_units: int,
    *,
    local_steps: int,
    scale_local_entropy: bool = True,
    weighted: bool = False,
    reset_optimizer: bool = False,
    num_particles: int = 1,
    stl: bool = True,
    padded: bool = True,
    barycenter: str = "fixed_point",
) -> FederatedAlgorithm:
    """
    Build SFVI-Avg's pure functions (Hassan et al., Algorithm 2).

    :param callable model: the federated model.
    :param guide: an :class:`~numpyro_fed.AutoGlobalLocalNormal` guide, already set up.
    :param optimizer: optax transformation used by every silo's local steps.
    :param dict template: one unit of silo data (:func:`~numpyro_fed.densities.data_template`).
    :param int num_units: :math:`N`, units in the pooled data (each silo scales its
        terms by :math:`N/N_j`).
    :param int local_steps: :math:`m`, local steps per round.
    :param bool scale_local_entropy: scale :math:`\\log q(z_{L_j} \\mid z_G)` by
        :math:`N/N_j` too.
    :param bool weighted: average with weights :math:`N_j/N` (the paper: uniform).
    :param bool reset_optimizer: restart the optimizer of the silo's copy of
        :math:`(\\theta, \\eta_G)` every round (default: carry it over).
    :param int num_particles: Monte Carlo draws per local step.
    :param bool stl: sticking-the-landing gradients.
    :param bool padded: some silos carry padded units.
    :param str barycenter: backend of the full-covariance barycenter,
        ``"fixed_point"`` (ours) or ``"ott"`` (ott-jax, the ``diagnostics`` extra);
        see :func:`~numpyro_fed.aggregate.w2_barycenter_fn`.
    :rtype: FederatedAlgorithm
    """
    full_barycenter = w2_barycenter_fn(barycenter)
    theta_c = guide.theta_constraints()
    global_c, local_c = guide.param_constraints()
    stop = jax.lax.stop_gradient if stl else (lambda x: x)

    def init_server(key: jax.Array) -> SFVIAvgServerState:
        return SFVIAvgServerState(*initial_globals(guide, key, template))

    def init_silo(key: jax.Array, data: SiloData) -> SFVIAvgSiloState:
        eta_local = unconstrain(local_c, guide.init_local(key, data.arrays))
        # The silo's optimizer of (theta, eta_G) needs only their shapes: trace the
        # server's initialization abstractly instead of running it on every silo.
        shapes = jax.eval_shape(init_server, key)
        zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
        return SFVIAvgSiloState(
            eta_local,
            optimizer.init(eta_local),
            optimizer.init((zeros.theta, zeros.eta_global)),
        )

    def server_message(state: SFVIAvgServerState, key) -> Message:
        del key
        return Message(SFVIAvgServerMessage(state.theta, state.eta_global))

    def surrogate(theta_u, eta_g_u, eta_l_u, key, data: SiloData):
        theta = constrain(theta_c, theta_u)
        eta_g = constrain(global_c, eta_g_u)
        scale = num_units / jnp.sum(data.mask)
        draw = draw_global(guide, eta_g, guide.global_noise(key))
        log_p, log_q = server_terms(
            model, guide, template, draw, theta, eta_g, stop=stop
        )
        local = silo_terms(
            model,
            guide,
            draw,
            theta,
            eta_g,
            constrain(local_c, eta_l_u),
            key,
            data,
            stop=stop,
            padded=padded,
        )
        entropy_scale = scale if scale_local_entropy else 1.0
        return log_p + scale * local.log_p - log_q - entropy_scale * local.log_q

    def particles_mean(theta_u, eta_g_u, eta_l_u, keys, data):
        per = jax.vmap(lambda k: surrogate(theta_u, eta_g_u, eta_l_u, k, data))(keys)
        return jnp.mean(per)

    grad = jax.value_and_grad(particles_mean, argnums=(0, 1, 2))

    def silo_step(message: Message, state: SFVIAvgSiloState, data: SiloData, step_keys):
        sent: SFVIAvgServerMessage = message.broadcast
        global_opt = state.global_optim_state
        if reset_optimizer:
            global_opt = optimizer.init((sent.theta, sent.eta_global))

        def local_step(carry, keys):
            (theta, eta_g), eta_l, opt_g, opt_l = carry
            elbo, (g_theta, g_eta_g, g_eta_l) = grad(theta, eta_g, eta_l, keys, data)
            globals_, opt_g = ascent(
                optimizer, (g_theta, g_eta_g), opt_g, (theta, eta_g)
            )
            eta_l, opt_l = ascent(optimizer, g_eta_l, opt_l, eta_l)
            return (globals_, eta_l, opt_g, opt_l), elbo

        carry = (
            (sent.theta, sent.eta_global),
            state.eta_local,
            global_opt,
            state.optim_state,
        )
        carry, elbos = jax.lax.scan(local_step, carry, step_keys)
        (theta, eta_g), eta_l, opt_g, opt_l = carry
        new_state = SFVIAvgSiloState(eta_l, opt_l, opt_g)
        reply = SFVIAvgSiloMessage(theta, eta_g, elbos[-1], jnp.sum(data.mask))
        return reply, new_state

    def _barycenter(eta_g_u, weights):
        eta = jax.vmap(lambda e: constrain(global_c, e))(eta_g_u)
        # Parameters other than the Gaussian's (a shared encoder's weights) are
        # averaged in unconstrained space, like theta.
        others = {
            k: weighted_mean(v, weights)
            for k, v in eta_g_u.items()
            if k not in ("loc", "scale", "tril")
        }
        if "tril" not in eta:
            (loc, scale), _ = w2_barycenter_diag(eta["loc"], eta["scale"], weights)
            return {**others, **unconstrain(global_c, {"loc": loc, "scale": scale})}
        covs = jax.vmap(lambda s, t: scale_tril_to_cov(s, unit_tril(t)))(
            eta["scale"], eta["tril"]
        )
        (loc, cov), _ = full_barycenter(eta["loc"], covs, weights)
        scale, tril = cov_to_scale_tril(cov)
        gaussian = unconstrain(global_c, {"loc": loc, "scale": scale, "tril": tril})
        return {**others, **gaussian}

    def server_step(
        state: SFVIAvgServerState, replies: SFVIAvgSiloMessage, key, participating
    ):
        del key
        used = participating
        sizes = replies.num_units.astype(replies.elbo.dtype)
        weights = jnp.where(used, sizes if weighted else 1.0, 0.0)
        theta = weighted_mean(replies.theta, weights) if state.theta else state.theta
        eta_g = _barycenter(replies.eta_global, weights) if state.eta_global else {}
        # No usable message this round: keep the server's state.
        kept = tree_where(jnp.any(used), SFVIAvgServerState(theta, eta_g), state)
        clean = jnp.where(used, replies.elbo, 0.0)
        loss = -jnp.sum(clean) / jnp.maximum(jnp.sum(used), 1)
        return kept, SFVIInfo(loss, jnp.zeros_like(used))

    return guard_nonfinite(
        FederatedAlgorithm(
            init_server, init_silo, server_message, silo_step, server_step
        )
    )
