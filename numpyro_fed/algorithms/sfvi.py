# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""SFVI: structured federated variational inference (Hassan et al., Algorithm 1).

Each round the server draws :math:`\\epsilon_G` and broadcasts it (as the keys it
drew it from) with :math:`(\\theta, \\eta_G)`; every silo draws its own
:math:`\\epsilon_{L_j}`, takes one optimizer step on its local parameters
:math:`\\eta_{L_j}` and returns only the gradients of its term
:math:`\\widehat{\\mathcal L}_j` with respect to :math:`(\\theta, \\eta_G)`; the server
adds the gradient of its own term :math:`\\widehat{\\mathcal L}_0 = \\log p_\\theta(z_G)
- \\log q_{\\eta_G}(z_G)` (which the paper's box omits) and steps :math:`(\\theta, \\eta_G)`. The summed gradient is
exactly the centralized (STL) ELBO gradient (Supplement S1, eqs. S4-S8), so SFVI is
centralized VI computed where the data live.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from numpyro_fed.elbo import (
    draw_global,
    initial_globals,
    server_terms,
    silo_terms,
)
from numpyro_fed.guard import guard_nonfinite, guarded_sum, sums_finite
from numpyro_fed.protocol import (
    FederatedAlgorithm,
    Message,
    SiloData,
    SummedReplies,
    reply_sum,
)
from numpyro_fed.util import (
    ascent,
    constrain,
    rows_where,
    tree_where,
    unconstrain,
)

__all__ = [
    "SFVIInfo",
    "SFVIServerMessage",
    "SFVIServerState",
    "SFVISiloMessage",
    "SFVISiloState",
    "sfvi",
]


class SFVIServerState(NamedTuple):
    """- **theta** - unconstrained model parameters :math:`\\theta`.
    - **eta_global** - unconstrained global variational parameters :math:`\\eta_G`.
    - **optim_state** - the server optimizer's state over ``(theta, eta_global)``.
    """

    theta: dict
    eta_global: dict
    optim_state: Any


class SFVISiloState(NamedTuple):
    """- **eta_local** - unconstrained local variational parameters (units first).
    - **optim_state** - the silo optimizer's state; never leaves the silo.
    """

    eta_local: dict
    optim_state: Any


class SFVIServerMessage(NamedTuple):
    """Server -> silos.

    - **theta** - unconstrained :math:`\\theta`.
    - **eta_global** - unconstrained :math:`\\eta_G`.
    - **global_keys** - the server's keys of :math:`\\epsilon_G`, one per particle:
      every silo draws the same :math:`\\epsilon_G` from them (a key is smaller than
      the draw it stands for, and it is the server's own randomness).
    """

    theta: dict
    eta_global: dict
    global_keys: jax.Array


class SFVISiloMessage(NamedTuple):
    """Silo -> server.

    - **grad_theta** - :math:`g_j^\\theta`, ELBO gradient w.r.t. unconstrained theta.
    - **grad_eta_global** - :math:`g_j^\\eta`, ELBO gradient w.r.t. unconstrained
      :math:`\\eta_G`.
    - **elbo** - the scalar :math:`\\widehat{\\mathcal L}_j` (for the loss trace; an
      extra disclosure beyond the paper's messages, zero when ``report_elbo=False``).
    """

    grad_theta: dict
    grad_eta_global: dict
    elbo: jax.Array


class SFVIInfo(NamedTuple):
    """- **loss** - the negative ELBO estimate of the round (at the pre-update state).
    - **rejected** - ``(J,)`` booleans: silos whose reply arrived but was not finite
      and was left out.
    """

    loss: jax.Array
    rejected: jax.Array


def sfvi(
    model: Callable,
    guide: Any,
    optimizer: optax.GradientTransformation,
    template: dict,
    *,
    num_particles: int = 1,
    stl: bool = True,
    report_elbo: bool = True,
    padded: bool = True,
    end_to_end: bool | None = None,
) -> FederatedAlgorithm:
    """
    Build SFVI's pure functions (Hassan et al., Algorithm 1).

    :param callable model: the federated model.
    :param guide: an :class:`~numpyro_fed.AutoGlobalLocalNormal` guide, already set up.
    :param optimizer: an optax transformation; elementwise ones (Adam, SGD) make the
        split server/silo states identical to one centralized optimizer.
    :param dict template: one unit of silo data
        (:func:`~numpyro_fed.densities.data_template`), on which the server term is
        evaluated.
    :param int num_particles: Monte Carlo draws per round.
    :param bool stl: use the sticking-the-landing estimator (Roeder et al. 2017);
        ``False`` gives NumPyro's ``Trace_ELBO`` gradient.
    :param bool report_elbo: silos send their scalar ELBO term (for the loss trace).
    :param bool padded: some silos carry padded units that must be masked out;
        ``False`` (every silo full) skips the masking.
    :param end_to_end: on CPU, compute the simulated round's silo terms on all the
        silos' units laid end to end (the centralized step's array layout, which
        XLA:CPU runs several times faster than the vmapped one), where the guide's
        local factors are per unit and no nested plate is ragged; the round is then
        taken again silo by silo only when a sum is not finite. ``None`` (default):
        when the silos hold at least 256 units in all and more than one each (else
        the layout gains nothing and the second path only adds compile time).
    :return: the algorithm.
    :rtype: FederatedAlgorithm
    """
    theta_constraints = guide.theta_constraints()
    global_constraints, local_constraints = guide.param_constraints()
    stop = jax.lax.stop_gradient if stl else (lambda x: x)

    def init_server(key: jax.Array) -> SFVIServerState:
        theta, eta_global = initial_globals(guide, key, template)
        return SFVIServerState(theta, eta_global, optimizer.init((theta, eta_global)))

    def init_silo(key: jax.Array, data: SiloData) -> SFVISiloState:
        eta_local = unconstrain(local_constraints, guide.init_local(key, data.arrays))
        return SFVISiloState(eta_local, optimizer.init(eta_local))

    def server_message(state: SFVIServerState, keys: jax.Array) -> Message:
        return Message(SFVIServerMessage(state.theta, state.eta_global, keys))

    def global_noise(message: SFVIServerMessage) -> jax.Array:
        return jax.vmap(guide.global_noise)(message.global_keys)

    def shared_values(theta_u, eta_g_u, eps):
        """What every silo's term reads of the server's quantities: constrained
        theta and eta_G, and each particle's global draw."""
        eta_g = constrain(global_constraints, eta_g_u)
        draws = jax.vmap(lambda e: draw_global(guide, eta_g, e))(eps)
        return constrain(theta_constraints, theta_u), eta_g, draws

    def particle_mean(particle, draws, keys):
        """``particle(draw, key)`` averaged over the particles (the leading axis of
        ``draws`` and ``keys``)."""
        if num_particles == 1:
            # Without the particle vmap's unit axis XLA's CPU loops run over one
            # fewer dimension of every (silo, unit, ...) array: a faster round.
            return particle(jax.tree.map(lambda x: x[0], draws), keys[0])
        return jnp.mean(jax.vmap(particle)(draws, keys))

    def silo_value(shared, eta_l_u, keys, data: SiloData):
        """The silo's ELBO term, averaged over the particles."""
        theta, eta_g, draws = shared
        eta_l = constrain(local_constraints, eta_l_u)

        def particle(draw, key):
            terms = silo_terms(
                model, guide, draw, theta, eta_g, eta_l, key, data,
                stop=stop, padded=padded,
            )  # fmt: skip
            return terms.log_p - terms.log_q

        return particle_mean(particle, draws, keys)

    def silo_objective(theta_u, eta_g_u, eta_l_u, eps, keys, data):
        return silo_value(shared_values(theta_u, eta_g_u, eps), eta_l_u, keys, data)

    silo_grad = jax.value_and_grad(silo_objective, argnums=(0, 1, 2))

    def local_ascent(g_eta_l, state: SFVISiloState) -> SFVISiloState:
        return SFVISiloState(
            *ascent(optimizer, g_eta_l, state.optim_state, state.eta_local)
        )

    def reply_of(g_theta, g_eta_g, elbo) -> SFVISiloMessage:
        return SFVISiloMessage(
            g_theta, g_eta_g, elbo if report_elbo else jnp.zeros_like(elbo)
        )

    def silo_step(message: Message, state: SFVISiloState, data: SiloData, keys):
        sent: SFVIServerMessage = message.broadcast
        elbo, (g_theta, g_eta_g, g_eta_l) = silo_grad(
            sent.theta,
            sent.eta_global,
            state.eta_local,
            global_noise(sent),
            keys,
            data,
        )
        return reply_of(g_theta, g_eta_g, elbo), local_ascent(g_eta_l, state)

    def units_end_to_end(shared, eta_l_u, keys, data: SiloData, contacted):
        """The contacted silos' summed ELBO terms, computed on all their units laid
        end to end: ``(J, P, ...)`` arrays as ``(J * P, ...)``, each unit's noise
        from its own silo's key. The same sum as :func:`silo_value` silo by silo,
        in the layout of a centralized step: XLA's CPU loops run an elementwise
        fusion over ``(J, P, ...)`` several times slower than over ``(J * P, ...)``
        (scalar code for short trailing axes, packed vector code for long ones)."""
        theta, eta_g, draws = shared

        def end_to_end(x):
            return x.reshape((x.shape[0] * x.shape[1], *x.shape[2:]))

        units = SiloData(
            jax.tree.map(end_to_end, data.arrays),
            end_to_end(data.mask & contacted[:, None]),
            end_to_end(data.unit_ids),
        )
        eta_l = constrain(local_constraints, jax.tree.map(end_to_end, eta_l_u))

        def particle(draw, silo_keys):
            noise = guide.local_noise(silo_keys, data.unit_ids)
            terms = silo_terms(
                model, guide, draw, theta, eta_g, eta_l, None, units,
                stop=stop, noise=end_to_end(noise),
            )  # fmt: skip
            return terms.log_p - terms.log_q

        # keys: (J, particles); each particle takes every silo's key of its own
        return particle_mean(particle, draws, jnp.swapaxes(keys, 0, 1))

    def silo_by_silo(shared, states: SFVISiloState, data, keys, contacted):
        each = jax.vmap(
            jax.value_and_grad(silo_value, argnums=(0, 1)), in_axes=(None, 0, 0, 0)
        )
        elbos, (g_shared, g_eta_l) = each(shared, states.eta_local, keys, data)
        stepped = jax.vmap(local_ascent, axis_size=contacted.shape[0])(g_eta_l, states)
        used, (elbo, g_total), new_states = guarded_sum(
            contacted, (elbos, g_shared), stepped, states
        )
        return used, elbo, g_total, new_states

    def all_at_once(shared, states: SFVISiloState, data, keys, contacted):
        elbo, (g_total, g_eta_l) = jax.value_and_grad(units_end_to_end, argnums=(0, 1))(
            shared, states.eta_local, keys, data, contacted
        )
        stepped = jax.vmap(local_ascent, axis_size=contacted.shape[0])(g_eta_l, states)
        # The guard's silo rule as guarded_sum keeps it: finite sums pass every
        # contacted silo; otherwise the round is taken again silo by silo.
        return jax.lax.cond(
            sums_finite((elbo, g_total), stepped),
            lambda: (contacted, elbo, g_total, rows_where(contacted, stepped, states)),
            lambda: silo_by_silo(shared, states, data, keys, contacted),
        )

    def reduce_silos(message: Message, states: SFVISiloState, data, keys, contacted):
        # The silos' gradient stops at the shared values (a few numbers); the
        # pull-back through the global draw and its transforms to (theta, eta_G)
        # then runs once, on the sum. A silo whose gradient or new state is not
        # finite is left out of the sum (the per-silo checks run only when a sum
        # is not finite).
        sent: SFVIServerMessage = message.broadcast
        shared, pull_back = jax.vjp(
            lambda t, e: shared_values(t, e, global_noise(sent)),
            sent.theta,
            sent.eta_global,
        )
        operands = (shared, states, data, keys, contacted)
        # One unit a silo is already the end-to-end layout; a few hundred units
        # in all are too few for the layout to matter.
        auto = data.mask.shape[1] > 1 and data.mask.size >= 256
        wanted = auto if end_to_end is None else end_to_end
        if wanted and guide.units_separable and not data.nested:
            # On CPU all units at once (a branch; accelerators run silo by silo).
            used, elbo, g_total, new_states = jax.lax.platform_dependent(
                *operands, cpu=all_at_once, default=silo_by_silo
            )
        else:
            used, elbo, g_total, new_states = silo_by_silo(*operands)
        g_theta, g_eta_g = pull_back(g_total)
        return SummedReplies(reply_of(g_theta, g_eta_g, elbo), used), new_states

    def server_value(theta_u, eta_g_u, eps):
        """The server's term, averaged over the particles."""
        eta_g = constrain(global_constraints, eta_g_u)
        theta = constrain(theta_constraints, theta_u)

        def particle(e):
            log_p, log_q = server_terms(
                model, guide, template, draw_global(guide, eta_g, e), theta, eta_g,
                stop=stop,
            )  # fmt: skip
            return log_p - log_q

        return jnp.mean(jax.vmap(particle)(eps))

    server_grad = jax.value_and_grad(server_value, argnums=(0, 1))

    def server_step(
        state: SFVIServerState, replies: SFVISiloMessage, keys, participating
    ):
        eps = jax.vmap(guide.global_noise)(keys)
        elbo0, (g_theta, g_eta_g) = server_grad(state.theta, state.eta_global, eps)
        used = participating
        # A uniformly random subset of k silos, scaled by J / k, sums to the full
        # gradient in expectation (exactly 1 when every silo is used).
        scale = used.shape[0] / jnp.maximum(jnp.sum(used), 1)
        silos = reply_sum(replies, used)
        grads = jax.tree.map(
            lambda own, total: own + scale * total,
            (g_theta, g_eta_g),
            (silos.grad_theta, silos.grad_eta_global),
        )
        elbo = elbo0 + scale * silos.elbo
        (theta, eta_global), optim_state = ascent(
            optimizer, grads, state.optim_state, (state.theta, state.eta_global)
        )
        stepped = SFVIServerState(theta, eta_global, optim_state)
        # With no silo's term the gradient is the prior's alone: take no step.
        new = tree_where(jnp.any(used), stepped, state)
        return new, SFVIInfo(-elbo, jnp.zeros_like(used))

    return guard_nonfinite(
        FederatedAlgorithm(
            init_server,
            init_silo,
            server_message,
            silo_step,
            server_step,
            reduce_silos=reduce_silos,
        )
    )
