# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Fed-GVI with a variational cavity (Patel, 2024; seed 004).

Generalized VI replaces the log-likelihood by a loss and KL-to-the-prior by a divergence
:math:`D`. Each silo keeps a Gaussian loss factor :math:`l_m = -\\eta_m^\\top T(u)`; the
server's posterior is itself a GVI optimum over the summed factors,
:math:`q_s = \\arg\\min_q E_q[\\sum_k l_k] + D(q \\| \\pi_0)`, and silo :math:`m`'s
cavity is defined variationally by dropping its own loss,
:math:`q^{\\backslash m} = \\arg\\min_q E_q[l_s - l_m] + D(q \\| \\pi_0)`. Because
:math:`E_q[l_k]` is linear in :math:`\\eta_k`, both need only the aggregate
:math:`\\sum_k \\eta_k`: the server never sends an individual silo's factor. With
:math:`D = KL` and the log-likelihood loss this is exactly PVI.
"""

from typing import Any, Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
import numpyro.distributions as dist
import optax

from numpyro_fed.algorithms.pvi import pvi
from numpyro_fed.algorithms.pvi_messages import Cavity
from numpyro_fed.expfam import (
    GaussianNat,
    expected_log_factor,
    from_moments,
    is_full,
    is_valid,
    kl,
    renyi,
)
from numpyro_fed.protocol import FederatedAlgorithm
from numpyro_fed.util import constrain

__all__ = [
    "FedGVIServerMessage",
    "beta_divergence_loss",
    "fedgvi",
    "gce_loss",
    "gvi_posterior",
    "renyi_divergence",
    "variational_cavity",
]


# ------------------------------------------------------------------ losses
def gce_loss(gamma: float) -> Callable:
    """Generalized cross-entropy: each observation contributes
    :math:`(p(y \\mid u)^\\gamma - 1) / \\gamma` in place of :math:`\\log p(y \\mid u)`
    (bounded below, so a mislabeled point cannot dominate; :math:`\\gamma \\to 0` is
    the log-likelihood).

    :param float gamma: in (0, 1].
    """
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma must be in (0, 1], got {gamma!r}.")

    def observed_fn(site: dict, log_prob: jax.Array) -> jax.Array:
        del site
        return jnp.expm1(gamma * log_prob) / gamma

    return observed_fn


def _integral_power(fn, power: float) -> jax.Array:
    """:math:`\\int p(y)^{power} dy` elementwise over the batch of ``fn``."""
    if isinstance(fn, dist.Normal):
        return (2 * jnp.pi * fn.scale**2) ** ((1 - power) / 2) / jnp.sqrt(power)
    if fn.has_enumerate_support:
        support = fn.enumerate_support(expand=True)
        return jnp.sum(jnp.exp(power * fn.log_prob(support)), 0)
    raise NotImplementedError(
        f"The beta-divergence loss needs the integral of p(y)^(1+beta): available for "
        f"Normal and for discrete likelihoods, not {type(fn).__name__}."
    )


def beta_divergence_loss(beta: float) -> Callable:
    """The density-power (:math:`\\beta`-divergence) loss of Basu et al.: each
    observation contributes :math:`p(y \\mid u)^\\beta / \\beta - \\int p^{1+\\beta} /
    (1+\\beta)` (shifted by :math:`1/\\beta` so that :math:`\\beta \\to 0` gives the
    log-likelihood); Normal and discrete likelihoods.

    :param float beta: positive.
    """
    if not beta > 0:
        raise ValueError(f"beta must be positive, got {beta!r}.")

    def observed_fn(site: dict, log_prob: jax.Array) -> jax.Array:
        fn, mask = site["fn"], True
        if isinstance(fn, dist.MaskedDistribution):  # a padded silo's units
            fn, mask = fn.base_dist, fn._mask
        while isinstance(fn, (dist.Independent, dist.ExpandedDistribution)):
            fn = fn.base_dist
        integral = jnp.broadcast_to(_integral_power(fn, 1 + beta), jnp.shape(log_prob))
        value = jnp.expm1(beta * log_prob) / beta - (integral - 1) / (1 + beta)
        return jnp.where(mask, value, 0.0)

    return observed_fn


# ------------------------------------------------------------- divergences
def renyi_divergence(alpha: float) -> Callable:
    """:math:`(q, p) \\mapsto D_\\alpha(q \\| p)`, the Rényi divergence of order
    ``alpha`` in (0, 1) (closed form for Gaussians)."""
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must be in (0, 1), got {alpha!r}.")
    return lambda q, p: renyi(q, p, alpha)


def _newton(objective: Callable, params: jax.Array, num_steps: int) -> jax.Array:
    """Damped Newton iterations on a smooth objective of a small flat vector: a step
    is taken only if it lowers the objective (otherwise its half, or nothing)."""
    grad_fn, hess_fn = jax.grad(objective), jax.hessian(objective)

    def step(x, _):
        g, h = grad_fn(x), hess_fn(x)
        h = 0.5 * (h + h.T)
        # Levenberg safeguard: a positive-definite system away from the optimum.
        shift = jnp.maximum(0.0, -jnp.min(jnp.linalg.eigvalsh(h))) + 1e-10
        direction = jnp.linalg.solve(h + shift * jnp.eye(x.shape[0]), g)
        value = objective(x)
        candidates = [x - direction, x - 0.5 * direction, x - 0.125 * direction]
        best = x
        for c in reversed(candidates):
            best = jnp.where(objective(c) < value, c, best)
        return best, None

    params, _ = lax.scan(step, params, None, length=num_steps)
    return params


def gvi_posterior(
    aggregate: GaussianNat,
    prior: GaussianNat,
    divergence: Callable,
    num_steps: int = 20,
) -> GaussianNat:
    """:math:`\\arg\\min_q -E_q[\\eta^\\top T(u)] + D(q \\| \\pi_0)` over Gaussians of
    the kind of ``prior`` (diagonal or full), for the aggregated factor
    :math:`\\eta` = ``aggregate``. Closed form for :math:`D = KL`
    (:math:`\\pi_0 \\cdot t`); otherwise ``num_steps`` damped Newton iterations from
    that closed form, over (mean, log-Cholesky) coordinates; a diagonal family is
    solved coordinate by coordinate (the objective separates).

    :param GaussianNat aggregate: summed loss factors.
    :param GaussianNat prior: the prior :math:`\\pi_0`.
    :param callable divergence: ``(q, p) -> D(q || p)``; :func:`~numpyro_fed.expfam.kl`
        for the closed form.
    :param int num_steps: Newton iterations.
    """
    start = prior.plus(aggregate)
    if divergence is kl:
        return start
    start = jax.tree.map(lambda a, b: jnp.where(is_valid(start), a, b), start, prior)
    if not is_full(prior):
        one = jax.vmap(
            lambda a_h, a_p, p_h, p_p, s_h, s_p: gvi_posterior(
                GaussianNat(a_h[None], a_p[None, None]),
                GaussianNat(p_h[None], p_p[None, None]),
                divergence,
                num_steps,
            )
        )
        q = one(aggregate.h, aggregate.prec, prior.h, prior.prec, start.h, start.prec)
        return GaussianNat(q.h[:, 0], q.prec[:, 0, 0])
    d = prior.h.shape[-1]
    rows, cols = jnp.tril_indices(d)

    def unpack(x):
        loc = x[:d]
        chol = jnp.zeros((d, d), x.dtype).at[rows, cols].set(x[d:])
        chol = jnp.tril(chol, -1) + jnp.diag(jnp.exp(jnp.diagonal(chol)))
        return from_moments(loc, chol @ chol.T)

    def objective(x):
        q = unpack(x)
        return -expected_log_factor(aggregate, q) + divergence(q, prior)

    chol = jnp.linalg.cholesky(jnp.linalg.inv(start.prec))
    raw = jnp.tril(chol, -1) + jnp.diag(jnp.log(jnp.diagonal(chol)))
    x0 = jnp.concatenate([jnp.linalg.solve(start.prec, start.h), raw[rows, cols]])
    return unpack(_newton(objective, x0, num_steps))


# ------------------------------------------------------------ the algorithm
class FedGVIServerMessage(NamedTuple):
    """Server -> silos, the broadcast part.

    - **q** - the server's GVI posterior :math:`q_s` (the silos' starting point).
    - **theta** - unconstrained model parameters.
    - **aggregate** - :math:`\\sum_k \\eta_k`, the silos' factors summed (never an
      individual one).
    """

    q: GaussianNat
    theta: dict
    aggregate: GaussianNat


def variational_cavity(
    divergence: Callable, prior_at: Callable | None, num_steps: int = 20
) -> Cavity:
    """Fed-GVI's messages and cavity: the server sends :math:`q_s` and the aggregate;
    silo :math:`m`'s cavity is the GVI posterior of the aggregate less its own factor.

    :param callable divergence: ``(q, p) -> D(q || p)``.
    :param callable prior_at: ``theta -> GaussianNat`` (unconstrained ``theta``), the
        exact Gaussian prior; ``None`` when the server refines a factor for a
        non-Gaussian prior (KL only: the cavity is then PVI's :math:`q / t_m`).
    :param int num_steps: Newton iterations of a non-KL :func:`gvi_posterior`.
    :rtype: ~numpyro_fed.algorithms.pvi_messages.Cavity
    """
    if prior_at is None:
        if divergence is not kl:
            raise NotImplementedError(
                "A divergence other than KL needs a prior that is Gaussian in "
                "unconstrained space (Normal or MultivariateNormal on real sites, with "
                "fixed parameters); this model's prior is not."
            )
        return Cavity(
            lambda q, prior, theta: FedGVIServerMessage(q, theta, q.minus(prior)),
            lambda message, factor: message.q.minus(factor),
            divergence,
        )

    def message(q, prior, theta):
        # The server's authoritative state is prior + sum_k eta_k; it sends the
        # aggregate and its GVI posterior, never an individual factor.
        aggregate = q.minus(prior)
        q_s = gvi_posterior(aggregate, prior, divergence, num_steps)
        return FedGVIServerMessage(q_s, theta, aggregate)

    def of(message, factor):
        aggregate = message.aggregate.minus(factor)
        return gvi_posterior(aggregate, prior_at(message.theta), divergence, num_steps)

    return Cavity(message, of, divergence)


def fedgvi(
    model: Callable,
    guide: Any,
    local_optim: optax.GradientTransformation,
    template: dict,
    *,
    prior_of: Callable | None,
    loss: Callable | None = None,
    divergence: Callable = kl,
    cavity_steps: int = 20,
    **pvi_options: Any,
) -> FederatedAlgorithm:
    """
    Build Fed-GVI with a variational cavity (Patel, 2024): PVI
    (:func:`~numpyro_fed.algorithms.pvi.pvi`) with ``loss`` in place of each
    observation's log-likelihood and :func:`variational_cavity` in place of
    :math:`q / t_m`.

    :param callable model: the federated model.
    :param guide: an :class:`~numpyro_fed.AutoGlobalLocalNormal` guide, already set up.
    :param local_optim: the silos' optax optimizer.
    :param dict template: one unit of silo data (:func:`~numpyro_fed.densities.data_template`).
    :param callable prior_of: as for :func:`~numpyro_fed.algorithms.pvi.pvi`.
    :param callable loss: ``(site, log_prob) -> value`` per observation (e.g.
        :func:`gce_loss`); ``None`` keeps the log-likelihood.
    :param callable divergence: ``(q, p) -> D(q || p)`` (e.g.
        :func:`renyi_divergence`); :func:`~numpyro_fed.expfam.kl` gives PVI's cavity.
    :param int cavity_steps: Newton iterations for a non-KL variational cavity.
    :param pvi_options: the remaining keyword arguments of
        :func:`~numpyro_fed.algorithms.pvi.pvi` (``num_silos``, ``local_steps``,
        ``damping``, ...).
    :rtype: FederatedAlgorithm

    **References:**

    1. *Variational cavity for federated generalized variational inference*,
       Patel (2024).
    """
    theta_c = guide.theta_constraints()
    prior_at = None
    if prior_of is not None:
        prior_at = lambda theta: prior_of(constrain(theta_c, theta))
    cavity = variational_cavity(divergence, prior_at, cavity_steps)
    return pvi(
        model,
        guide,
        local_optim,
        template,
        prior_of=prior_of,
        observed_fn=loss,
        cavity=cavity,
        **pvi_options,
    )
