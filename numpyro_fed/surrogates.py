# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Gaussian surrogates of each silo's likelihood, for conducive gradients.

FSGLD (El Mekkaoui et al., §3.1) needs, for every silo :math:`s`, a tractable
:math:`q_s(\\theta) \\approx p(x_s \\mid \\theta)` of the silo's likelihood of the
global sites, fitted once on the silo. A Gaussian :math:`q_s = \\mathcal N(\\mu_s,
\\Lambda_s^{-1})` is kept as natural parameters, an
:class:`~numpyro_fed.expfam.GaussianNat` :math:`(h_s = \\Lambda_s \\mu_s,
\\Lambda_s)` stacked by silo, so the product :math:`q = \\prod_s q_s` is a sum and

.. math::

    \\nabla \\log q_s(\\theta) = h_s - \\Lambda_s \\theta

(:func:`~numpyro_fed.expfam.grad_log_density`) costs one matrix-vector product (one
elementwise product for a diagonal precision), whatever the number of silos.
:math:`\\theta` is the flattened unconstrained global position of
:class:`~numpyro_fed.potentials.FederatedPotential`. A silo with local latent sites
fits a Gaussian to its joint local likelihood of :math:`(z_G, z_{L_s})` and keeps the
marginal of :math:`z_G`, which approximates
:math:`p(x_s \\mid z_G) = \\int p(x_s, z_{L_s} \\mid z_G)\\, dz_{L_s}`.
"""

from typing import Any, Callable
import warnings

import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
import numpy as np
import optax

from numpyro_fed.checks import check_count
from numpyro_fed.expfam import GaussianNat
from numpyro_fed.potentials import FederatedPotential, federated_potential

__all__ = ["check_surrogates", "fit_surrogates"]

_METHODS = ("laplace", "sgld", "vi", "taylor")
_NOT_IDENTIFIED = (
    "its likelihood may not identify every global coordinate: fit with "
    "prior_power > 0, or with more data on that silo"
)


def _tolerances(dtype: Any) -> tuple[float, float, float, float]:
    """``(eps, gradient, round-off, floor)`` of ``dtype``: the Laplace fit has
    reached its mode when its gradient relative to the target is below sqrt(eps)
    (1.5e-8 in float64, 3.5e-4 in float32: round-off in a silo's summed gradient
    keeps it about there); an eigenvalue below round-off relative to the largest is
    round-off of a singular Hessian; clipped curvature is raised to the floor
    relative to the largest (above round-off, so it passes check_surrogates)."""
    dtype = np.dtype(dtype)
    eps = float(np.finfo(dtype if dtype.kind in "fc" else np.float64).eps)
    return eps, eps**0.5, max(1e-10, 10 * eps), max(1e-8, 1000 * eps)


def check_surrogates(
    s: GaussianNat, num_silos: int | None = None, dim: int | None = None
) -> GaussianNat:
    """
    Validate surrogates: shapes, finite values and a positive-definite precision for
    every silo. A precision is refused as not positive definite when its smallest
    eigenvalue is not above round-off relative to its largest (``1e-10`` in float64,
    ``10 eps`` in float32), and as numerically zero when that eigenvalue is below the
    dtype's ``eps`` in unconstrained units (a standard deviation above
    ``1 / sqrt(eps)``: :math:`6.7 \times 10^7` in float64): such a surrogate is flat,
    not a Gaussian.

    :param GaussianNat s: the surrogates, stacked by silo.
    :param int num_silos: the expected number of silos.
    :param int dim: the expected dimension of the flattened global position.
    :return: ``s``, unchanged.
    :raises ValueError: naming the silo at fault.

    **Example:**

    .. doctest::

        >>> import numpy as np
        >>> from numpyro_fed.expfam import GaussianNat
        >>> from numpyro_fed.surrogates import check_surrogates
        >>> bad = GaussianNat(h=np.zeros((2, 1)), prec=np.array([[1.0], [-2.0]]))
        >>> check_surrogates(bad)
        Traceback (most recent call last):
        ...
        ValueError: The surrogate of silo 1 has a precision that is not positive definite (smallest eigenvalue -2); ...
    """
    return _check(s, num_silos, dim, _NOT_IDENTIFIED)


def _check(
    s: GaussianNat, num_silos: int | None, dim: int | None, advice: str
) -> GaussianNat:
    """:func:`check_surrogates`, with ``advice`` on the likely cause of a precision
    that is not positive definite or is numerically zero."""
    if not isinstance(s, GaussianNat):
        raise TypeError(
            "surrogates must be an expfam.GaussianNat stacked by silo (from "
            f"nf.fit_surrogates); got {type(s).__name__}."
        )
    precision, shift = np.asarray(s.prec), np.asarray(s.h)
    if shift.ndim != 2 or precision.shape not in (
        shift.shape,
        shift.shape + shift.shape[1:],
    ):
        raise ValueError(
            "surrogates need h (S, D) and prec (S, D) or (S, D, D); got "
            f"{shift.shape} and {precision.shape}."
        )
    if num_silos is not None and shift.shape[0] != num_silos:
        raise ValueError(
            f"There are surrogates for {shift.shape[0]} silos but the data hold "
            f"{num_silos} silos: fit one surrogate per silo of this data."
        )
    if dim is not None and shift.shape[1] != dim:
        raise ValueError(
            f"The surrogates have dimension {shift.shape[1]} but the model's flattened "
            f"global sites have {dim}."
        )
    for j in range(shift.shape[0]):
        if not (np.isfinite(precision[j]).all() and np.isfinite(shift[j]).all()):
            raise ValueError(f"The surrogate of silo {j} has non-finite parameters.")
        p = precision[j]
        if p.ndim == 2:
            if not np.allclose(p, p.T, rtol=1e-6, atol=1e-8 * np.abs(p).max()):
                raise ValueError(
                    f"The surrogate of silo {j} has a non-symmetric precision."
                )
            eig = np.linalg.eigvalsh(p)
        else:
            eig = p
        smallest = float(eig.min())
        eps, _, round_off, _ = _tolerances(precision.dtype)
        # Relative threshold: a rank-deficient Hessian leaves round-off, not zeros.
        if not smallest > round_off * float(np.abs(eig).max()):
            raise ValueError(
                f"The surrogate of silo {j} has a precision that is not positive "
                f"definite (smallest eigenvalue {smallest:.3g}); {advice}."
            )
        if not smallest > eps:
            raise ValueError(
                f"The surrogate of silo {j} has a precision that is numerically zero "
                f"(smallest eigenvalue {smallest:.3g}, below {precision.dtype}'s eps "
                f"{eps:.3g}): it is flat in some direction, not a Gaussian; {advice}."
            )
    return s


# ------------------------------------------------------------------ fitting
def _silo_objective(
    pot: FederatedPotential, prior_power: float, arrays, mask, nested, z_local0
):
    """Joint log target of one silo over the flat ``(z_G, z_Ls)`` vector."""
    flat_local, unravel_local = ravel_pytree(z_local0)
    dim = pot.global_dim

    def log_target(u):
        z_g = pot.unflatten(u[:dim])
        z_l = unravel_local(u[dim:])
        value = pot.silo_log_likelihood(z_g, z_l, arrays, mask, nested)
        if prior_power:
            value = value + prior_power * pot.log_prior(z_g)
        # Padded units' local latents (and padded entries of ragged nested plates)
        # carry no density; a unit Gaussian keeps them (and the joint Hessian) well
        # defined without touching the z_G marginal.
        real = pot.real_local(z_l, mask, nested)
        for name, v in z_l.items():
            value = value - 0.5 * jnp.sum(jnp.where(real[name], 0.0, v) ** 2)
        return value

    return log_target, flat_local


def _marginal(mean, cov_or_precision, dim, diagonal, is_precision):
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


def _fit_laplace(log_target, u0, num_steps, proper):
    """Mode by damped Newton (Levenberg-Marquardt): a step is kept only if it lowers
    the loss, and the damping shrinks after a success and grows after a failure, so
    it is Newton near a mode and gradient descent far from one. Exact in one step on
    a Gaussian target, and much cheaper to compile than a line-search quasi-Newton.

    Returns the last iterate, the negative Hessian there (made proper by
    :func:`_proper_curvature` if it is not), the relative gradient norm before the
    last step (above :func:`_tolerances`' gradient: stopped by ``num_steps``) and whether the
    curvature had to be clipped. ``proper``: the target includes a share of the
    prior, so zero curvature is flatness to clip, not a coordinate the silo's
    likelihood does not identify (left for :func:`check_surrogates` to report)."""
    _, tol, round_off, _ = _tolerances(u0.dtype)
    loss = lambda u: -log_target(u)
    eye = jnp.eye(u0.shape[0], dtype=u0.dtype)

    def cond(carry):
        _, _, i, gnorm = carry
        return (i < num_steps) & (gnorm > tol)

    def body(carry):
        u, damping, i, _ = carry
        value, grad = jax.value_and_grad(loss)(u)
        hess = jax.hessian(loss)(u)
        proposal = u - jnp.linalg.solve(hess + damping * eye, grad)
        better = loss(proposal) <= value
        u = jnp.where(better, proposal, u)
        damping = jnp.where(better, damping / 10, damping * 10)
        # The gradient scales with the silo's size: compare it to |value| + 1. It
        # is the gradient before this step, so a converged fit ends with one more
        # Newton step, which takes it to round-off.
        gnorm = jnp.max(jnp.abs(grad)) / (jnp.abs(value) + 1.0)
        return u, jnp.clip(damping, 1e-12, 1e12), i + 1, gnorm

    start = (u0, jnp.asarray(1e-3, u0.dtype), jnp.zeros((), jnp.int32), jnp.inf)
    u, _, _, gnorm = jax.lax.while_loop(cond, body, start)
    hess = jax.hessian(loss)(u)
    eig, vec = jnp.linalg.eigh(0.5 * (hess + hess.T))
    # Without a prior share, only curvature that is negative beyond round-off is
    # clipped: a singular Hessian (a likelihood that does not identify every
    # coordinate) is left for check_surrogates to report. With one, zero and
    # round-off curvature are flatness and are clipped too. A proper Hessian is
    # kept bit for bit.
    bound = round_off * jnp.max(jnp.abs(eig))
    improper = eig[0] <= bound if proper else eig[0] < -bound
    hess = jnp.where(improper, _proper_curvature(eig, vec), hess)
    return u, hess, gnorm, improper


def _curvature_floor(eig):
    return _tolerances(eig.dtype)[3] * jnp.max(jnp.abs(eig))


def _proper_curvature(eig, vec):
    """The symmetric matrix ``vec diag(eig) vec^T`` with eigenvalues raised to a small
    positive floor: a proper Gaussian that is nearly flat where the target curves
    down, so a conducive gradient does (almost) nothing in those directions."""
    return (vec * jnp.maximum(eig, _curvature_floor(eig))) @ vec.T


def _fit_taylor(log_target, u0):
    """Second-order Taylor expansion of the log target at ``u0``, as a Gaussian: the
    negative Hessian with its negative curvature clipped to a small positive floor
    (so the Gaussian is proper), centred one Newton step from ``u0``. Its gradient
    equals the target's at ``u0`` exactly, which is what makes it a good control
    variate near ``u0`` (the idea of SGLD-CV, Baker et al. 2019). Also returns the
    gradient, which the diagonal form reuses."""
    grad = jax.grad(log_target)(u0)
    hess = -jax.hessian(log_target)(u0)
    eig, vec = jnp.linalg.eigh(0.5 * (hess + hess.T))
    eig = jnp.maximum(eig, _curvature_floor(eig))
    precision = (vec * eig) @ vec.T
    mean = u0 + (vec / eig) @ (vec.T @ grad)
    return mean, precision, grad


def _fit_sgld(
    log_target, u0, key, step_size, num_warmup, num_samples, thinning, dim, diagonal
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

    warm_key, key = jax.random.split(key)
    u = jax.lax.fori_loop(
        0, num_warmup, lambda i, u: langevin(u, jax.random.fold_in(warm_key, i)), u0
    )
    anchor = u[:dim]  # sums of deviations from a draw: fewer cancellation errors

    def body(carry, k):
        u, total, outer = carry
        u = step(u, k)
        d = u[:dim] - anchor
        outer = outer + (d * d if diagonal else jnp.outer(d, d))
        return (u, total + d, outer), None

    zeros = jnp.zeros((dim,) if diagonal else (dim, dim))
    keys = jax.random.split(key, num_samples)
    (u, total, outer), _ = jax.lax.scan(body, (u, jnp.zeros(dim), zeros), keys)
    mean_d = total / num_samples
    cov = outer / num_samples - (
        mean_d * mean_d if diagonal else jnp.outer(mean_d, mean_d)
    )
    return anchor + mean_d, cov


def _fit_vi(log_target, u0, key, num_steps, learning_rate, num_particles, diagonal):
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
    params = jax.tree.map(lambda t: t / (num_steps - start), total)
    L = scale_tril(params)
    cov = L**2 if diagonal else L @ L.T
    return params["loc"], cov


def _warn_unconverged(gnorm, improper, num_steps, tol):
    stopped = np.flatnonzero(gnorm > tol).tolist()
    clipped = np.flatnonzero(improper).tolist()
    if not (stopped or clipped):
        return
    parts = []
    if stopped:
        parts.append(
            f"The Laplace fit stopped before a mode on silo(s) {stopped} (after "
            f"num_steps={num_steps} Newton steps the gradient is up to "
            f"{gnorm.max():.2g} relative to the target, above {tol:.2g}): "
            "raise num_steps, or start nearer a mode with init_params."
        )
    if clipped:
        parts.append(
            f"On silo(s) {clipped} the fit ends where the target curves down (or is "
            "flat) in some directions; those curvatures were raised to a small "
            "positive floor, so "
            "the surrogate is nearly flat, and the conducive gradient nearly off, in "
            "those directions."
        )
    warnings.warn(" ".join(parts), UserWarning, stacklevel=3)


def fit_surrogates(
    model: Callable,
    data: Any,
    method: str = "laplace",
    covariance: str = "full",
    *,
    rng_key: jax.Array | None = None,
    prior_power: float = 0.0,
    num_steps: int = 500,
    step_size: float | None = None,
    num_warmup: int = 1000,
    num_samples: int = 3000,
    thinning: int = 1,
    learning_rate: float = 1e-2,
    num_particles: int = 8,
    init_params: dict | None = None,
    silo_batch_size: int | None = None,
) -> GaussianNat:
    """
    Fit one Gaussian :math:`q_s` per silo to the silo's likelihood of the global
    sites, each on its own data only (El Mekkaoui et al., §3.1); only the natural
    parameters leave a silo, once. Silos are fitted in one :func:`jax.vmap`.

    Methods:

    - ``"laplace"``: mode by damped Newton (at most ``num_steps`` iterations, until
      the gradient is below :math:`\\sqrt{\\epsilon}` of the dtype relative to the
      target's value: 1.5e-8 in float64, 3.5e-4 in float32), then the negative
      Hessian there (with local latents, the Schur complement: the Laplace
      approximation of the marginal likelihood). Exact for a Gaussian likelihood.
      On a target that is not log-concave, a fit stopped by ``num_steps`` may end
      where the target curves down: that curvature is raised to a small positive
      floor (the surrogate is nearly flat there), and a warning names the silos that
      stopped short or were clipped. With ``prior_power > 0`` the target is proper,
      so zero and round-off curvature are clipped too; without it they are reported
      (the silo's likelihood may not identify that direction).
    - ``"sgld"``: Langevin dynamics on the local likelihood (full silo gradient,
      ``step_size``, ``num_warmup`` then ``num_samples`` steps), then moment matching,
      as in the paper (3,000 draws).
    - ``"vi"``: a Gaussian fitted by maximizing the ELBO of the local likelihood
      (Adam, ``num_steps``, ``learning_rate``, ``num_particles``; the second half of
      the iterates is averaged).
    - ``"taylor"``: the second-order Taylor expansion of the silo's target at a
      point the server chooses (``init_params``, shared by every silo: e.g. the
      state of a short chain), with negative curvature clipped to a small positive
      floor. No optimization; its gradient equals the silo's at that point (with
      local latents: the gradient of the quadratic's marginal), so the
      conducive gradient there removes the between-silo variance exactly (a
      control variate in the manner of SGLD-CV). Exact for a Gaussian likelihood;
      for a likelihood whose gradient saturates (ReLU networks, logistic links) the
      quadratic outgrows it away from the point, so keep the chain near it.

    A silo whose data do not identify every global coordinate (e.g. a logistic
    regression silo holding one class) has an improper likelihood; ``prior_power``
    :math:`w > 0` fits :math:`q_s \\approx p(\\theta)^w p(x_s \\mid \\theta)` instead.
    The conducive gradient stays unbiased for any :math:`q_s`, and with
    :math:`w = f_s` (e.g. ``1 / num_silos`` for uniform silo probabilities) the
    prior shares cancel exactly in it.

    :param callable model: the federated model.
    :param FederatedData data: the silos' data.
    :param str method: ``"laplace"``, ``"sgld"``, ``"vi"`` or ``"taylor"``.
    :param str covariance: ``"full"`` or ``"diag"`` (diagonal: the marginal
        variances are matched).
    :param jax.random.key rng_key: key for the initial values and for ``"sgld"`` and
        ``"vi"`` (default ``jax.random.key(0)``).
    :param float prior_power: power of the prior included in each silo's target.
    :param int num_steps: optimizer iterations for ``"laplace"`` and ``"vi"``.
    :param float step_size: Langevin step size, required for ``"sgld"``.
    :param int num_warmup: discarded Langevin steps (``"sgld"``).
    :param int num_samples: Langevin draws for the moments (``"sgld"``).
    :param int thinning: Langevin steps per kept draw (``"sgld"``): autocorrelated
        draws understate the variance, so a slowly mixing silo chain needs thinning
        for its moments to match the silo's target.
    :param float learning_rate: Adam's learning rate (``"vi"``).
    :param int num_particles: Monte Carlo draws per ELBO gradient (``"vi"``).
    :param dict init_params: unconstrained global sites to start every silo's fit
        from (default: the model's ``init_to_uniform``). For multimodal models (a
        neural network's weight symmetries) a common point near one mode, e.g. the
        end of a short DSGLD run, keeps the silos' surrogates in the same basin.
    :param int silo_batch_size: silos fitted at once (default: all, in one
        :func:`jax.vmap`); a smaller batch bounds the memory a large silo's Hessian
        or Langevin chain takes, at no change to the result.
    :return: the natural parameters :math:`(h_s, \\Lambda_s)`, stacked by silo.
    :rtype: ~numpyro_fed.expfam.GaussianNat
    :raises ValueError: for an unknown method or covariance, a missing step size, or
        a fitted surrogate that is not a valid Gaussian (naming the silo).

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp, numpy as np
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
        ...     with nf.silo_plate("data", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
        >>> data = nf.FederatedData.from_groups([0, 0, 1], y=jnp.array([1.0, 2, 4]))
        >>> q = nf.fit_surrogates(model, data, method="laplace")
        >>> q.prec.ravel().round(3).tolist(), q.h.ravel().round(3).tolist()
        ([2.0, 1.0], [3.0, 4.0])
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}.")
    if covariance not in ("full", "diag"):
        raise ValueError(f"covariance must be 'full' or 'diag', got {covariance!r}.")
    if method == "sgld" and not (step_size is not None and step_size > 0):
        raise ValueError(
            f"method='sgld' needs a positive step_size, got {step_size!r} (a step of "
            "about 0.1 / (units per silo) is a reasonable start for a well-scaled model)."
        )
    num_steps = check_count("num_steps", num_steps)
    num_warmup = check_count("num_warmup", num_warmup, minimum=0)
    num_samples = check_count("num_samples", num_samples)
    thinning = check_count("thinning", thinning)
    num_particles = check_count("num_particles", num_particles)
    if silo_batch_size is not None:
        silo_batch_size = check_count("silo_batch_size", silo_batch_size)
    if not prior_power >= 0:
        raise ValueError(f"prior_power must be >= 0, got {prior_power!r}.")
    diagonal = covariance == "diag"
    pot = federated_potential(model, data)
    rng_key = jax.random.key(0) if rng_key is None else rng_key
    init_key, fit_key = jax.random.split(rng_key)
    z0 = pot.init_position(init_key, data)
    if init_params is not None:
        missing = [s.name for s in pot.global_sites if s.name not in init_params]
        if missing:
            raise ValueError(f"init_params lacks the global site(s) {missing}.")
        # In the model's dtype: a weakly typed start (a Python float) would otherwise
        # turn the whole fit to float32.
        z0.update(
            {
                s.name: jnp.asarray(init_params[s.name], z0[s.name].dtype)
                for s in pot.global_sites
            }
        )
    z_local0 = pot.split(z0)[1]
    dim = pot.global_dim

    def fit_one(arrays, mask, nested, z_local, key):
        """A silo's natural parameters and, for ``"laplace"``, the relative gradient
        before the last Newton step and whether the curvature had to be clipped."""
        log_target, flat_local = _silo_objective(
            pot, prior_power, arrays, mask, nested, z_local
        )
        u0 = jnp.concatenate([pot.flatten(pot.split(z0)[0]), flat_local])
        if method == "laplace":
            mode, hess, gnorm, improper = _fit_laplace(
                log_target, u0, num_steps, prior_power > 0
            )
            return *_marginal(mode, hess, dim, diagonal, True), gnorm, improper
        return *fit_natural(log_target, u0, key), jnp.zeros(()), jnp.zeros((), bool)

    def fit_natural(log_target, u0, key):
        if method == "taylor":
            mean, precision, grad = _fit_taylor(log_target, u0)
            if diagonal and precision.shape[0] == dim:
                # The curvature along each axis, not the marginal precision: the
                # control variate should follow the gradient's change coordinate by
                # coordinate, and keep the target's gradient at u0.
                prec = jnp.diag(precision)
                return prec, prec * u0 + grad
            return _marginal(mean, precision, dim, diagonal, True)
        if method == "sgld":
            mean, cov = _fit_sgld(
                log_target,
                u0,
                key,
                step_size,
                num_warmup,
                num_samples,
                thinning,
                dim,
                diagonal,
            )
            prec = 1.0 / cov if diagonal else jnp.linalg.inv(cov)
            shift = prec * mean if diagonal else prec @ mean
            return prec, shift
        mean, cov = _fit_vi(
            log_target, u0, key, num_steps, learning_rate, num_particles, diagonal
        )
        return _marginal(mean, cov, dim, diagonal, False)

    keys = jax.random.split(fit_key, data.num_silos)
    inputs = (dict(data.arrays), data.mask, pot.nested, z_local0, keys)
    if silo_batch_size is None:
        prec, shift, gnorm, improper = jax.jit(jax.vmap(fit_one))(*inputs)
    else:
        # Bounded memory: a Hessian of a silo's full data, vmapped over every silo
        # at once, can outgrow the machine (30 silos of 3,000 rows and a 500-weight
        # network ask for ~40 GB).
        prec, shift, gnorm, improper = jax.jit(
            lambda a: jax.lax.map(lambda x: fit_one(*x), a, batch_size=silo_batch_size)
        )(inputs)
    if method == "laplace":
        tol = _tolerances(prec.dtype)[1]
        _warn_unconverged(np.asarray(gnorm), np.asarray(improper), num_steps, tol)
    advice = _NOT_IDENTIFIED
    if prior_power > 0:  # the target is proper: the fit, not the data, is at fault
        advice = (
            f"with prior_power={prior_power} the silo's target is proper, so the "
            f"{method!r} fit ended degenerate: "
            + (
                "where the target is flat or not finite (e.g. a funnel's neck); start "
                "nearer a mode (init_params), reparameterize the model, or use "
                "method='vi'"
                if method in ("laplace", "taylor")
                else "its moments are not those of a proper Gaussian; raise "
                "num_samples (and thinning) or num_steps"
            )
        )
    return _check(GaussianNat(shift, prec), data.num_silos, dim, advice)
