# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""PVI's schedules: synchronous (all silos from the same q, vmapped), and the
event-driven sequential / asynchronous ones (one silo at a time, each reading a
possibly stale q). Every update is acknowledged with the fraction the server applied,
so each silo's factor moves exactly as the server's q does."""

import jax
from jax import lax
import jax.numpy as jnp
import optax

from numpyro_fed.algorithms.pvi import (
    PVIFunctions,
    PVIInfo,
    PVIServerMessage,
    PVIServerState,
    PVISiloState,
    apply_update,
)
from numpyro_fed.expfam import is_valid
from numpyro_fed.protocol import SiloData
from numpyro_fed.util import all_finite

__all__ = ["event_round", "synchronous_round"]


def _where(ok, new, old):
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def _commit(state: PVISiloState, delta, scale, used) -> PVISiloState:
    factor = state.factor.plus(delta.times(jnp.where(used, scale, 0.0)))
    return state._replace(factor=factor)


def _first(flags: jax.Array) -> jax.Array:
    return jnp.where(jnp.any(flags), jnp.argmax(flags), -1)


def _prior_update(fns: PVIFunctions, server: PVIServerState):
    """The server refines t_0 (non-Gaussian prior) against the current q."""
    if fns.prior_step is None:
        return server, jnp.ones((), server.q.h.dtype)
    message = fns.message_of(server.q, server.prior, server.theta)
    reply, prior_silo = fns.prior_step(message, server.prior_silo, None)
    ok = all_finite(reply.delta)
    q, scale = apply_update(server.q, _where(ok, reply.delta, _zeros(reply.delta)))
    prior_silo = _commit(prior_silo, reply.delta, scale, ok)
    server = server._replace(q=q, prior=prior_silo.factor, prior_silo=prior_silo)
    return server, scale


def _zeros(tree):
    return jax.tree.map(jnp.zeros_like, tree)


def _server_finish(
    fns: PVIFunctions,
    hyper_optim: optax.GradientTransformation,
    server: PVIServerState,
    message: PVIServerMessage,
    grad_theta: dict,
    key: jax.Array,
):
    """The server's own ELBO term at the round's starting q and the theta step
    (Bui et al., eq. 5: silos' summed gradients plus the server's prior term)."""
    server_value, server_grad = fns.server_elbo(message.q, server.theta, key)
    if not server.theta:
        return server, server_value
    grads = jax.tree.map(jnp.add, grad_theta, server_grad)
    updates, optim_state = hyper_optim.update(
        jax.tree.map(jnp.negative, grads), server.optim_state, server.theta
    )
    theta = optax.apply_updates(server.theta, updates)
    ok = all_finite(theta)
    q, prior = server.q, server.prior
    if fns.prior_of is not None:
        # An exact prior that depends on theta moves q with it (q = p * prod t_m).
        new_prior = fns.prior_of(theta)
        q = server.q.plus(new_prior.minus(server.prior))
        ok = ok & is_valid(q)
        q, prior = _where(ok, (q, new_prior), (server.q, server.prior))
    new = server._replace(
        q=q,
        prior=prior,
        theta=_where(ok, theta, server.theta),
        optim_state=_where(ok, optim_state, server.optim_state),
    )
    return new, server_value


def synchronous_round(
    fns: PVIFunctions,
    hyper_optim: optax.GradientTransformation,
    server: PVIServerState,
    silos: PVISiloState,
    data: SiloData,
    key: jax.Array,
    participating: jax.Array,
):
    """Every participating silo updates from the same q; the server adds the summed
    update, shrinking it until q stays valid."""
    message = fns.message_of(server.q, server.prior, server.theta)
    replies, new_silos = jax.vmap(fns.silo_step, in_axes=(None, 0, 0))(
        message, silos, data
    )
    finite = jax.vmap(all_finite)((replies.delta, replies.elbo, replies.grad_theta))
    used = participating & finite & replies.valid_cavity
    weights = lambda x: used.reshape((-1,) + (1,) * (x.ndim - 1))  # noqa: E731
    total = jax.tree.map(
        lambda d: jnp.sum(jnp.where(weights(d), d, 0.0), 0), replies.delta
    )
    # t_0 and the silos move together from the same q.
    if fns.prior_step is not None:
        reply0, prior_silo = fns.prior_step(message, server.prior_silo, None)
        ok0 = all_finite(reply0.delta)
        total = total.plus(_where(ok0, reply0.delta, _zeros(reply0.delta)))
    q, scale = apply_update(server.q, total)
    if fns.prior_step is not None:
        prior_silo = _commit(prior_silo, reply0.delta, scale, ok0)
        server = server._replace(prior=prior_silo.factor, prior_silo=prior_silo)
    new_silos = jax.vmap(_commit, in_axes=(0, 0, None, 0))(
        new_silos, replies.delta, scale, used
    )
    silos = jax.tree.map(
        lambda n, o: jnp.where(
            participating.reshape((-1,) + (1,) * (n.ndim - 1)), n, o
        ),
        new_silos,
        silos,
    )
    grad_theta = jax.tree.map(
        lambda g: jnp.sum(jnp.where(weights(g), g, 0.0), 0), replies.grad_theta
    )
    server = server._replace(q=q)
    server, server_value = _server_finish(
        fns, hyper_optim, server, message, grad_theta, key
    )
    count = jnp.maximum(jnp.sum(used), 1)
    elbo = server_value + used.shape[0] / count * jnp.sum(
        jnp.where(used, replies.elbo, 0.0)
    )
    info = PVIInfo(
        elbo,
        scale,
        jnp.sum(participating & ~finite),
        _first(participating & ~replies.valid_cavity),
    )
    return server, silos, info


def event_round(
    fns: PVIFunctions,
    hyper_optim: optax.GradientTransformation,
    server: PVIServerState,
    silos: PVISiloState,
    data: SiloData,
    key: jax.Array,
    participating: jax.Array,
    order: jax.Array,
    staleness: jax.Array,
):
    """One pass over the silos in ``order``, applying each update as it arrives.

    Silo ``order[i]`` computes its update from the version of q that is
    ``staleness[i]`` updates old (0: the current q, the sequential schedule); the
    server applies it to the current q. ``server.stale`` holds the recent versions.
    """
    server, prior_scale = _prior_update(fns, server)
    start = fns.message_of(server.q, server.prior, server.theta)
    stale = server.stale
    if stale is None:
        stale = jax.tree.map(lambda x: x[None], server.q)
    stale = jax.tree.map(lambda buf, x: buf.at[0].set(x), stale, server.q)

    def event(carry, inputs):
        q, stale, silos = carry
        j, lag = inputs
        read = jax.tree.map(lambda buf: buf[jnp.minimum(lag, buf.shape[0] - 1)], stale)
        silo = jax.tree.map(lambda x: x[j], silos)
        silo_data = jax.tree.map(lambda x: x[j], data)
        message = fns.message_of(read, server.prior, server.theta)
        reply, new = fns.silo_step(message, silo, silo_data)
        finite = all_finite((reply.delta, reply.elbo, reply.grad_theta))
        used = participating[j] & finite & reply.valid_cavity
        q, scale = apply_update(q, _where(used, reply.delta, _zeros(reply.delta)))
        new = _commit(_where(participating[j], new, silo), reply.delta, scale, used)
        silos = jax.tree.map(lambda x, y: x.at[j].set(y), silos, new)
        stale = jax.tree.map(
            lambda buf, x: jnp.concatenate([x[None], buf[:-1]]), stale, q
        )
        out = (
            used,
            jnp.where(used, scale, 1.0),
            jnp.where(used, reply.elbo, 0.0),
            jax.tree.map(lambda g: jnp.where(used, g, 0.0), reply.grad_theta),
            participating[j] & ~finite,
            participating[j] & ~reply.valid_cavity,
        )
        return (q, stale, silos), out

    (q, stale, silos), outs = lax.scan(
        event, (server.q, stale, silos), (order, staleness)
    )
    used, scales, elbos, grads, rejected, invalid = outs
    server = server._replace(q=q, stale=stale if server.stale is not None else None)
    grad_theta = jax.tree.map(lambda g: jnp.sum(g, 0), grads)
    server, server_value = _server_finish(
        fns, hyper_optim, server, start, grad_theta, key
    )
    count = jnp.maximum(jnp.sum(used), 1)
    elbo = server_value + used.shape[0] / count * jnp.sum(elbos)
    invalid_silo = jnp.where(jnp.any(invalid), order[jnp.argmax(invalid)], -1)
    info = PVIInfo(
        elbo,
        jnp.minimum(jnp.min(scales), prior_scale),
        jnp.sum(rejected),
        invalid_silo,
    )
    return server, silos, info
