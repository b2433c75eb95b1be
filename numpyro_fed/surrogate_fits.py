# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The per-silo fits behind :func:`~numpyro_fed.fit_surrogates`: pure functions of a
silo's log target over the flat :math:`(z_G, z_{L_s})` vector, each returning a
Gaussian's moments or natural parameters (Laplace by damped Newton, a clipped Taylor
expansion, Langevin moments, Gaussian VI). ``report`` (or ``None``) is called inside
the loops with the number of steps just done, for a progress bar."""

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "curvature_floor",
    "fit_laplace",
    "fit_sgld",
    "fit_taylor",
    "fit_vi",
    "integration_shift",
    "marginal",
    "proper_curvature",
    "tick",
    "tick_rest",
    "tolerances",
]

Report = Callable[[jax.Array], None] | None


def tolerances(dtype: Any) -> tuple[float, float, float, float]:
    """``(eps, gradient, round-off, floor)`` of ``dtype``: the Laplace fit has
    reached its mode when its gradient relative to the target is below sqrt(eps)
    (1.5e-8 in float64, 3.5e-4 in float32: round-off in a silo's summed gradient
    keeps it about there); an eigenvalue below round-off relative to the largest is
    round-off of a singular Hessian; clipped curvature is raised to the floor
    relative to the largest (above round-off, so it passes check_surrogates)."""
    dtype = np.dtype(dtype)
    eps = float(np.finfo(dtype if dtype.kind in "fc" else np.float64).eps)
    return eps, eps**0.5, max(1e-10, 10 * eps), max(1e-8, 1000 * eps)


def _every(length: int) -> int:
    """Steps between two reports: about 50 reports per loop."""
    return max(1, length // 50)


def tick(report: Report, i: jax.Array, length: int) -> None:
    """In step ``i`` (0-based) of a loop of ``length`` steps, report every
    :func:`_every` steps. ``i`` must not be batched (a ``scan`` or ``fori_loop``
    index), so that under ``vmap`` this stays a ``cond``, not a ``select`` that
    would report on every step."""
    if report is None:
        return
    every = _every(length)
    jax.lax.cond((i + 1) % every == 0, lambda: report(jnp.asarray(every)), lambda: None)


def tick_rest(report: Report, length: int) -> None:
    """After a loop of ``length`` steps: the steps :func:`tick` left unreported."""
    rest = length % _every(length)
    if report is not None and rest:
        report(jnp.asarray(rest))


def marginal(mean, cov_or_precision, dim, diagonal, is_precision):
    """Natural parameters of the z_G marginal of a joint Gaussian."""
    if is_precision:
        h = cov_or_precision
        if h.shape[0] > dim:
            h_gg, h_gl, h_ll = h[:dim, :dim], h[:dim, dim:], h[dim:, dim:]
            prec = h_gg - h_gl @ jnp.linalg.solve(h_ll, h_gl.T)
        else:
            prec = h
        prec = 0.5 * (prec + prec.T)
        if diagonal:
            prec = 1.0 / jnp.diag(jnp.linalg.inv(prec))
    elif cov_or_precision.ndim == 1:  # a mean-field fit: variances
        prec = 1.0 / cov_or_precision[:dim]
    else:
        cov = cov_or_precision[:dim, :dim]
        prec = 1.0 / jnp.diag(cov) if diagonal else jnp.linalg.inv(cov)
    mu = mean[:dim]
    shift = prec * mu if diagonal else prec @ mu
    return prec, shift


def fit_laplace(log_target, u0, num_steps, proper, report: Report = None):
    """Mode by damped Newton (Levenberg-Marquardt): a step is kept only if it lowers
    the loss, and the damping shrinks after a success and grows after a failure, so
    it is Newton near a mode and gradient descent far from one. Exact in one step on
    a Gaussian target, and much cheaper to compile than a line-search quasi-Newton.

    Returns the last iterate, the negative Hessian there (made proper by
    :func:`proper_curvature` if it is not), the relative gradient norm before the
    last step (above :func:`tolerances`' gradient: stopped by ``num_steps``) and
    whether the curvature had to be clipped. ``proper``: the target includes a share of the
    prior, so zero curvature is flatness to clip, not a coordinate the silo's
    likelihood does not identify (left for
    :func:`~numpyro_fed.surrogates.check_surrogates` to report)."""
    _, tol, round_off, _ = tolerances(u0.dtype)
    loss = lambda u: -log_target(u)
    eye = jnp.eye(u0.shape[0], dtype=u0.dtype)

    def derivatives(u):
        value, grad = jax.value_and_grad(loss)(u)
        return value, grad, jax.hessian(loss)(u)

    def cond(carry):
        i, gnorm = carry[-2:]
        return (i < num_steps) & (gnorm > tol)

    def body(carry):
        u, value, grad, hess, damping, i, _ = carry
        if report is not None:
            # Under vmap a batched while_loop runs this body for finished silos
            # too (their carry frozen): only the silos still running count.
            report(cond(carry).astype(jnp.int32))
        proposal = u - jnp.linalg.solve(hess + damping * eye, grad)
        new = derivatives(proposal)
        # A step to where the loss, its gradient or its curvature is not finite
        # (down a funnel, where a scale underflows to 0) is refused like a worse
        # one: the iterate and its Hessian stay finite.
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in new]))
        better = finite & (new[0] <= value)
        keep = lambda a, b: jnp.where(better, a, b)  # noqa: E731
        # The gradient scales with the silo's size: compare it to |value| + 1. It
        # is the gradient before this step, so a converged fit ends with one more
        # Newton step, which takes it to round-off.
        gnorm = jnp.max(jnp.abs(grad)) / (jnp.abs(value) + 1.0)
        damping = jnp.clip(jnp.where(better, damping / 10, damping * 10), 1e-12, 1e12)
        u, value, grad, hess = (
            keep(a, b)
            for a, b in zip((proposal, *new), (u, value, grad, hess), strict=True)
        )
        return u, value, grad, hess, damping, i + 1, gnorm

    damping0 = jnp.asarray(1e-3, u0.dtype)
    start = (u0, *derivatives(u0), damping0, jnp.zeros((), jnp.int32), jnp.inf)
    u, _, _, hess, _, steps, gnorm = jax.lax.while_loop(cond, body, start)
    if report is not None:  # a converged silo's unused steps
        report(num_steps - steps)
    eig, vec = jnp.linalg.eigh(0.5 * (hess + hess.T))
    # Without a prior share, only curvature that is negative beyond round-off is
    # clipped: a singular Hessian (a likelihood that does not identify every
    # coordinate) is left for check_surrogates to report. With one, zero and
    # round-off curvature are flatness and are clipped too. A proper Hessian is
    # kept bit for bit.
    bound = round_off * jnp.max(jnp.abs(eig))
    improper = eig[0] <= bound if proper else eig[0] < -bound
    hess = jnp.where(improper, proper_curvature(eig, vec), hess)
    return u, hess, gnorm, improper


def integration_shift(log_target, u, hess, dim):
    """How far the joint mode ``u`` of a silo's target over :math:`(z_G, z_{L_s})` is
    from the mode of its Laplace-approximated marginal in :math:`z_G`, in the
    marginal's standard deviations, per global coordinate: the Newton step of
    :math:`\\log \\int p(z_G, z_L) dz_L \\approx \\log p(z_G, \\hat z_L(z_G)) -
    \\tfrac12 \\log\\det A_{LL}(z_G)` from ``u``, where :math:`A` is the negative
    Hessian ``hess``. Zero when the local curvature :math:`A_{LL}` does not depend on
    the position (a Gaussian hierarchy with known scales). Large where the local
    sites' scale is a global site: the joint density concentrates where that scale
    shrinks (a funnel) and its mode says nothing about the marginal's."""
    if u.shape[0] == dim:
        return jnp.zeros(dim, u.dtype)

    def volume(v):
        a = -jax.hessian(log_target)(v)[dim:, dim:]
        return -0.5 * jnp.linalg.slogdet(0.5 * (a + a.T))[1]

    grad = jax.grad(volume)(u)
    # The local mode moves with z_G (dz_L/dz_G = -A_LL^{-1} A_LG): the total
    # derivative of the volume term along the marginal.
    total = grad[:dim] - hess[:dim, dim:] @ jnp.linalg.solve(
        hess[dim:, dim:], grad[dim:]
    )
    prec, _ = marginal(u, hess, dim, False, True)
    # A marginal flat in some direction (no prior share) moves without bound
    # there: floored, its shift is huge but finite and names the coordinate.
    eig, vec = jnp.linalg.eigh(prec)
    cov = (vec / jnp.maximum(eig, curvature_floor(eig))) @ vec.T
    return (cov @ total) / jnp.sqrt(jnp.abs(jnp.diag(cov)))


def curvature_floor(eig):
    """The smallest curvature a fit keeps: the dtype's floor relative to the
    largest eigenvalue ``eig`` (:func:`tolerances`)."""
    return tolerances(eig.dtype)[3] * jnp.max(jnp.abs(eig))


def proper_curvature(eig, vec):
    """The symmetric matrix ``vec diag(eig) vec^T`` with eigenvalues raised to a small
    positive floor: a proper Gaussian that is nearly flat where the target curves
    down, so a conducive gradient does (almost) nothing in those directions."""
    return (vec * jnp.maximum(eig, curvature_floor(eig))) @ vec.T


def fit_taylor(log_target, u0, report: Report = None):
    """Second-order Taylor expansion of the log target at ``u0``, as a Gaussian: the
    negative Hessian with its negative curvature clipped to a small positive floor
    (so the Gaussian is proper), centred one Newton step from ``u0``. Its gradient
    equals the target's at ``u0`` exactly, which is what makes it a good control
    variate near ``u0`` (the idea of SGLD-CV, Baker et al. 2019). Also returns the
    gradient, which the diagonal form reuses."""
    grad = jax.grad(log_target)(u0)
    hess = -jax.hessian(log_target)(u0)
    eig, vec = jnp.linalg.eigh(0.5 * (hess + hess.T))
    eig = jnp.maximum(eig, curvature_floor(eig))
    precision = (vec * eig) @ vec.T
    mean = u0 + (vec / eig) @ (vec.T @ grad)
    if report is not None:  # its one step
        report(jnp.asarray(1))
    return mean, precision, grad


def fit_sgld(
    log_target,
    u0,
    key,
    step_size,
    num_warmup,
    num_samples,
    thinning,
    dim,
    diagonal,
    report: Report = None,
):
    grad = jax.grad(log_target)

    def langevin(u, k):
        noise = jax.random.normal(k, u.shape) * jnp.sqrt(step_size)
        return u + 0.5 * step_size * grad(u) + noise

    def step(u, k):
        if thinning == 1:  # the unthinned chain keeps its keys, hence its draws
            return langevin(u, k)
        return jax.lax.fori_loop(
            0, thinning, lambda i, u: langevin(u, jax.random.fold_in(k, i)), u
        )

    def warm(i, u):
        tick(report, i, num_warmup)
        return langevin(u, jax.random.fold_in(warm_key, i))

    warm_key, key = jax.random.split(key)
    u = jax.lax.fori_loop(0, num_warmup, warm, u0)
    tick_rest(report, num_warmup)
    anchor = u[:dim]  # sums of deviations from a draw: fewer cancellation errors

    def body(carry, inputs):
        u, total, outer = carry
        i, k = inputs
        tick(report, i, num_samples)
        u = step(u, k)
        d = u[:dim] - anchor
        outer = outer + (d * d if diagonal else jnp.outer(d, d))
        return (u, total + d, outer), None

    zeros = jnp.zeros((dim,) if diagonal else (dim, dim))
    keys = jax.random.split(key, num_samples)
    (u, total, outer), _ = jax.lax.scan(
        body, (u, jnp.zeros(dim), zeros), (jnp.arange(num_samples), keys)
    )
    tick_rest(report, num_samples)
    mean_d = total / num_samples
    cov = outer / num_samples - (
        mean_d * mean_d if diagonal else jnp.outer(mean_d, mean_d)
    )
    return anchor + mean_d, cov


def fit_vi(
    log_target,
    u0,
    key,
    num_steps,
    learning_rate,
    num_particles,
    diagonal,
    report: Report = None,
):
    n = u0.shape[0]
    params = {"loc": u0, "log_scale": jnp.full(n, -1.0)}
    if not diagonal:
        params["tril"] = jnp.zeros((n, n))

    def scale_tril(p):
        d = jnp.exp(p["log_scale"])
        if diagonal:
            return d
        return jnp.tril(p["tril"], -1) + jnp.diag(d)

    def neg_elbo(p, k):
        eps = jax.random.normal(k, (num_particles, n))
        L = scale_tril(p)
        u = p["loc"] + (eps * L if diagonal else eps @ L.T)
        return -jnp.mean(jax.vmap(log_target)(u)) - jnp.sum(p["log_scale"])

    opt = optax.adam(learning_rate)
    start = num_steps // 2

    def body(carry, inputs):
        p, state, total = carry
        i, k = inputs
        tick(report, i, num_steps)
        g = jax.grad(neg_elbo)(p, k)
        updates, state = opt.update(g, state, p)
        p = optax.apply_updates(p, updates)
        # Averaging the second half of the iterates (Polyak) removes most of the
        # stochastic-gradient jitter of the final iterate.
        keep = (i >= start).astype(u0.dtype)
        total = jax.tree.map(lambda t, x: t + keep * x, total, p)
        return (p, state, total), None

    keys = jax.random.split(key, num_steps)
    zeros = jax.tree.map(jnp.zeros_like, params)
    steps = jnp.arange(num_steps)
    (_, _, total), _ = jax.lax.scan(
        body, (params, opt.init(params), zeros), (steps, keys)
    )
    tick_rest(report, num_steps)
    params = jax.tree.map(lambda t: t / (num_steps - start), total)
    L = scale_tril(params)
    cov = L**2 if diagonal else L @ L.T
    return params["loc"], cov
