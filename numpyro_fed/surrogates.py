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
from tqdm.auto import tqdm

from numpyro_fed.checks import check_count
from numpyro_fed.expfam import GaussianNat
from numpyro_fed.potentials import FederatedPotential, federated_potential
from numpyro_fed.surrogate_fits import (
    fit_laplace,
    fit_sgld,
    fit_taylor,
    fit_vi,
    integration_shift,
    marginal,
    tolerances,
)

__all__ = ["check_surrogates", "fit_surrogates"]

_METHODS = ("laplace", "sgld", "vi", "taylor")
_NOT_IDENTIFIED = (
    "its likelihood may not identify every global coordinate: fit with "
    "prior_power > 0, or with more data on that silo"
)


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
        eps, _, round_off, _ = tolerances(precision.dtype)
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


# Integrating out the local latents moves a sound joint mode by a fraction of a
# standard deviation of the silo's marginal (1/sqrt(units) in a Gaussian hierarchy);
# more than this many says the joint mode is a funnel's neck, not the marginal's mode.
_MAX_SHIFT = 1.0
# A damped Newton fit that has not settled when its steps run out ends with a
# relative gradient of order one at most (a few more steps would do); one far above
# it is running down a target that is unbounded above, a funnel's neck (six cities'
# centred intercepts: 2.6e44 after 500 steps, with precisions of 1e88).
_RUNAWAY = 1e3


def _refuse_funnels(
    moved: np.ndarray,
    mode: np.ndarray,
    start: np.ndarray,
    gnorm: np.ndarray,
    pot: FederatedPotential,
):
    """Refuse a Laplace fit whose joint mode is far below its marginal's along a
    global coordinate (a funnel's neck), where that distance overflows, or that is
    still running away when its steps run out (relative gradient above
    ``_RUNAWAY``); warn where the mode is far in another direction (too few units
    to pin the local sites). Names the first such silo, the global coordinate at
    fault and the cause."""
    names = [
        s.name + (f"[{i}]" if int(np.prod(s.unconstrained_shape)) > 1 else "")
        for s in pot.global_sites
        for i in range(int(np.prod(s.unconstrained_shape)))
    ]
    runaway = ~(gnorm <= _RUNAWAY)
    bad = ~(np.abs(moved).max(axis=1) <= _MAX_SHIFT) | runaway
    if not bad.any():
        return
    j = int(np.flatnonzero(bad)[0])
    funnel = (
        "a funnel: the local sites are drawn at a scale that is a global site, so "
        "their joint density increases without bound as that scale goes to 0 (held "
        "only by the prior share, if any), and a Gaussian at the joint mode misstates "
        "what the silo says about the globals. Non-centre the local sites "
        "(numpyro.infer.reparam.LocScaleReparam, or loc + scale * a standard "
        "normal), or fit method='vi' or method='sgld', which average over them."
    )
    head = (
        f"Silo {j}: the Laplace fit of the joint density of the global and local "
        "sites has no mode near the mode of the silo's likelihood of the global "
        f"sites (silos {np.flatnonzero(bad).tolist()} alike); "
    )
    if runaway[j] or not np.isfinite(moved[j]).all():
        # The fit ran off toward a funnel's neck (where the joint density grows
        # without bound): the global coordinate it moved furthest is the scale.
        k = int(np.argmax(np.abs(mode[j] - start)))
        where = (
            f"where its relative gradient is still {gnorm[j]:.3g} when the steps "
            "run out (the loss falls without bound)"
            if runaway[j]
            else "where the local sites' curvature overflows"
        )
        raise ValueError(
            f"{head}the fit ran {names[k]!r} from {start[k]:.3g} to "
            f"{mode[j, k]:.3g} (unconstrained), {where}: {funnel}"
        )
    k = int(np.argmax(np.abs(moved[j])))
    cause = (
        f"integrating the local latents out moves {names[k]!r} (unconstrained "
        f"{mode[j, k]:.3g}) by {abs(moved[j, k]):.3g} standard deviations"
    )
    if moved[j, k] > 0:  # up, where the local sites spread: a scale at its neck
        raise ValueError(f"{head}{cause}, up: {funnel}")
    warnings.warn(
        f"{head}{cause}: the silo holds too few units to pin its local sites, so "
        "its surrogate is a rough one (the conducive gradient stays unbiased, but "
        "removes less variance). Fit method='vi' or method='sgld', which average "
        "over the local sites, or pool more units per silo.",
        UserWarning,
        stacklevel=3,
    )


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
    progress_bar: bool = True,
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
      (the silo's likelihood may not identify that direction). With local latents,
      a joint mode more than one marginal standard deviation below the mode of the
      silo's Laplace-marginal likelihood along a global site (a centred
      hierarchy's funnel, whose joint density grows without bound as a scale goes
      to 0) is refused, naming the silo and the site; off in another direction, it
      is a warning (too few units to pin the local sites).
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
    :param bool progress_bar: show one tqdm bar over every silo's steps (Newton,
        Langevin or Adam steps; a Laplace fit that converges early jumps to its
        silo's end), updated from inside the compiled fit, at no change to the
        result.
    :return: the natural parameters :math:`(h_s, \\Lambda_s)`, stacked by silo.
    :rtype: ~numpyro_fed.expfam.GaussianNat
    :raises ValueError: for an unknown method or covariance, a missing step size, a
        Laplace fit at a funnel's neck, or a fitted surrogate that is not a valid
        Gaussian (naming the silo).

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

    def fit_one(arrays, mask, nested, z_local, key, silo):
        """A silo's natural parameters and, for ``"laplace"``, the relative gradient
        before the last Newton step and whether the curvature had to be clipped."""
        report = None
        if progress_bar:

            def report(steps: jax.Array) -> None:
                # The silo's index is batched under vmap, so every silo reports
                # its own steps, even where ``steps`` is a constant.
                jax.debug.callback(lambda _, n: bar.update(int(n)), silo, steps)

        log_target, flat_local = _silo_objective(
            pot, prior_power, arrays, mask, nested, z_local
        )
        u0 = jnp.concatenate([pot.flatten(pot.split(z0)[0]), flat_local])
        if method == "laplace":
            mode, hess, gnorm, improper = fit_laplace(
                log_target, u0, num_steps, prior_power > 0, report
            )
            shift = integration_shift(log_target, mode, hess, dim)
            natural = marginal(mode, hess, dim, diagonal, True)
            return *natural, gnorm, improper, shift, mode[:dim]
        natural = fit_natural(log_target, u0, key, report)
        zeros = jnp.zeros(dim, u0.dtype)
        return *natural, jnp.zeros(()), jnp.zeros((), bool), zeros, zeros

    def fit_natural(log_target, u0, key, report):
        if method == "taylor":
            mean, precision, grad = fit_taylor(log_target, u0, report)
            if diagonal and precision.shape[0] == dim:
                # The curvature along each axis, not the marginal precision: the
                # control variate should follow the gradient's change coordinate by
                # coordinate, and keep the target's gradient at u0.
                prec = jnp.diag(precision)
                return prec, prec * u0 + grad
            return marginal(mean, precision, dim, diagonal, True)
        if method == "sgld":
            mean, cov = fit_sgld(
                log_target,
                u0,
                key,
                step_size,
                num_warmup,
                num_samples,
                thinning,
                dim,
                diagonal,
                report,
            )
            prec = 1.0 / cov if diagonal else jnp.linalg.inv(cov)
            shift = prec * mean if diagonal else prec @ mean
            return prec, shift
        mean, cov = fit_vi(
            log_target,
            u0,
            key,
            num_steps,
            learning_rate,
            num_particles,
            diagonal,
            report,
        )
        return marginal(mean, cov, dim, diagonal, False)

    steps = {"laplace": num_steps, "vi": num_steps, "taylor": 1}
    per_silo = steps.get(method, num_warmup + num_samples)
    bar = tqdm(
        total=data.num_silos * per_silo,
        desc=f"fit_surrogates ({method}, {data.num_silos} silos)",
        unit="step",
        disable=not progress_bar,
    )
    keys = jax.random.split(fit_key, data.num_silos)
    silos = jnp.arange(data.num_silos)
    inputs = (dict(data.arrays), data.mask, pot.nested, z_local0, keys, silos)
    try:
        if silo_batch_size is None:
            out = jax.jit(jax.vmap(fit_one))(*inputs)
        else:
            # Bounded memory: a Hessian of a silo's full data, vmapped over every
            # silo at once, can outgrow the machine (30 silos of 3,000 rows and a
            # 500-weight network ask for ~40 GB).
            out = jax.jit(
                lambda a: jax.lax.map(
                    lambda x: fit_one(*x), a, batch_size=silo_batch_size
                )
            )(inputs)
        jax.effects_barrier()  # every update has reached the bar
    finally:
        bar.close()
    prec, shift, gnorm, improper, moved, mode = out
    if method == "laplace":
        start = np.asarray(pot.flatten(pot.split(z0)[0]))
        _refuse_funnels(
            np.asarray(moved), np.asarray(mode), start, np.asarray(gnorm), pot
        )
        tol = tolerances(prec.dtype)[1]
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
