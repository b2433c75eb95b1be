# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Diagnostics of FSGLD and DSGLD from El Mekkaoui et al.: the gradient estimator's
exact variance (Figure 1), the grid estimators of Lemma 2's :math:`\\epsilon_s^2` and
Assumption 1's :math:`\\gamma_s^2` (Figure 4), and both errors of the posterior-mean
estimate against the number of samples (Figure 3b).

All gradients are of the flattened unconstrained global position :math:`\\theta` (see
:class:`~numpyro_fed.potentials.FederatedPotential`), and the per-datum gradients
:math:`\\nabla \\log p(x_i \\mid \\theta)` are those of one unit of the silo plate.
Models with local latent sites have no per-datum likelihood of :math:`\\theta` alone
(the locals would have to be integrated out), so these functions reject them.
"""

from typing import Any, Callable, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.expfam import GaussianNat, grad_log_density
from numpyro_fed.potentials import FederatedPotential, federated_potential
from numpyro_fed.surrogates import check_surrogates

__all__ = [
    "GradientVariance",
    "MeanErrorCurves",
    "epsilon_squared",
    "gamma_squared",
    "gradient_variance",
    "mean_error_curves",
    "warn_lagging_locals",
    "warn_diverged",
    "warn_low_ess",
]

#: The effective sample size below which :func:`warn_low_ess` warns: a mean's Monte
#: Carlo standard error is then over 0.05 posterior sd, so 4 standard errors exceed
#: 0.2 sd, the accuracy the reference suite asks of the samplers.
MIN_ESS = 400


def warn_lagging_locals(
    pot: FederatedPotential, silo_probs: Any, local_steps: int, name: str = "FSGLD"
) -> bool:
    """
    Warn when a chain's local sites lag behind its globals: with several silos and
    ``local_steps=0`` a silo's local sites move only while the chain visits it (a
    fraction :math:`f_s` of the steps), and its global gradient depends on them, so
    the global sds inflate and the means drift with the number of silos (issue 22:
    4.8x too wide on radon's 85 county silos; exact with one silo).

    :param FederatedPotential pot: the model's potentials.
    :param silo_probs: :math:`f`.
    :param int local_steps: the kernel's ``local_steps``.
    :param str name: the kernel's name, for the message.
    :return: whether it warned.
    """
    f = np.asarray(silo_probs)
    if not pot.local_sites or f.shape[0] < 2 or local_steps > 0:
        return False
    sites = ", ".join(s.name for s in pot.local_sites)
    warnings.warn(
        f"{name}: the local sites ({sites}) of each of the {f.shape[0]} silos move "
        f"only while the chain visits their silo (as rarely as {f.min():.3g} of the "
        "steps), and the global gradient depends on them: the global sds inflate "
        "and the means lag as silos get more numerous and smaller. Pass "
        "local_steps=5 to refresh a silo's locals at each step (docs/fsgld.md).",
        UserWarning,
        stacklevel=3,
    )
    return True


def warn_low_ess(
    samples: Any, min_ess: float = MIN_ESS, sites: Any = None, name: str = "FSGLD"
) -> dict:
    """
    Warn when the chains are too short for their posterior means to be trusted: at
    a small step size SGLD's draws are strongly autocorrelated, and the Monte Carlo
    standard error of a mean is :math:`\\mathrm{sd} / \\sqrt{\\mathrm{ESS}}`, which
    can exceed the sampler's own bias (issue 22: 150,000 steps on radon's 85 county
    silos left an ESS of 9-73 on its globals, means 0.1-0.3 sd from the truth by
    chance alone). Call it on the chains after ``MCMC.run``; the cure is more
    steps or a larger step size (within the size that keeps the chain unbiased).

    :param samples: an ``MCMC`` (its ``get_samples(group_by_chain=True)``; for an
        FSGLD or DSGLD run it first warns of the chains that diverged,
        :meth:`~numpyro_fed.infer.mcmc.FSGLD.warn_divergence`) or a dict site ->
        draws ``(chains, draws, ...)``.
    :param float min_ess: warn below this effective sample size (default
        :data:`MIN_ESS`: 4 Monte Carlo standard errors of a mean within 0.2 sd).
    :param sites: the site names to check (default every site).
    :param str name: the sampler's name, for the message.
    :return: site -> the smallest effective sample size over its coordinates
        (NumPyro's ``effective_sample_size``; sites with non-finite draws are left
        out: the divergence warning names their chains).

    **Example:**

    .. doctest::

        >>> import numpy as np, warnings
        >>> from numpyro_fed.sgld_diagnostics import warn_low_ess
        >>> x = np.random.default_rng(0).normal(size=(2, 1000))
        >>> with warnings.catch_warnings():
        ...     warnings.simplefilter("error")
        ...     ess = warn_low_ess({"mu": x})
        >>> ess["mu"] > 1500
        True
    """
    from numpyro.diagnostics import effective_sample_size

    if hasattr(samples, "get_samples"):
        warn = getattr(getattr(samples, "sampler", None), "warn_divergence", None)
        last_state = getattr(samples, "last_state", None)
        if warn is not None and last_state is not None:
            warn(last_state)
        samples = samples.get_samples(group_by_chain=True)
    names = list(samples) if sites is None else list(sites)
    out, low = {}, []
    for site in names:
        x = np.asarray(samples[site], dtype=float)
        if x.ndim < 2 or x.shape[1] < 4:
            raise ValueError(
                f"warn_low_ess needs draws of {site!r} shaped (chains, draws, ...) with "
                f"at least 4 draws per chain; got shape {x.shape}."
            )
        if not np.isfinite(x).all():
            continue
        ess = float(np.min(effective_sample_size(x)))
        out[site] = ess
        if ess < min_ess:
            low.append(f"{site} {ess:.0f}")
    if low:
        worst = min(out.values())
        warnings.warn(
            f"{name}: effective sample size below {min_ess:g} ({', '.join(low)} of "
            f"{x.shape[0] * x.shape[1]} draws): the Monte Carlo standard error of "
            f"those means is up to {1 / np.sqrt(worst):.2g} posterior sd, so they "
            "cannot be trusted to that accuracy. Run longer chains, or take a larger "
            "step_size if the chain stays unbiased there.",
            UserWarning,
            stacklevel=2,
        )
    return out


class GradientVariance(NamedTuple):
    r"""Exact per-step moments of the drift :math:`\psi` of FSGLD/DSGLD at one
    :math:`\theta`, over the silo :math:`s \sim \mathrm{Cat}(f)` and the minibatch.

    - **mean** - :math:`\mathbb E[\psi] = \nabla \log p(\theta) + \nabla \log
      p(x \mid \theta)`, ``(D,)``.
    - **within** - :math:`\sum_s f_s^{-1} \mathrm{tr}\,\mathrm{Cov}[\hat G_s \mid s]`,
      the minibatch part (0 for full batches).
    - **between** - :math:`\sum_s f_s \|f_s^{-1}(G_s - \alpha Q_s) - (G - \alpha Q)\|^2`,
      the silo-choice part, which exact surrogates with :math:`\alpha = 1` remove.
    - **total** - :math:`\mathrm{tr}\,\mathrm{Cov}[\psi]` = within + between.
    """

    mean: jax.Array
    within: jax.Array
    between: jax.Array
    total: jax.Array


class MeanErrorCurves(NamedTuple):
    r"""Errors of the posterior-mean estimate after :math:`t = 1, \dots, T` draws.

    - **squared_error** - :math:`\|\hat\mu_t - \bar\mu\|^2` with :math:`\hat\mu_t` the
      running mean of the draws (the paper's text, Figure 3b).
    - **mean_distance** - :math:`\frac1t \sum_{u \le t} \|\theta_u - \bar\mu\|`, the
      running mean of the draws' distance (the authors' notebook); it has a floor of
      about :math:`\sqrt{\pi/2}\,\sigma` even for exact draws.
    """

    squared_error: np.ndarray
    mean_distance: np.ndarray


def _global_only(pot: FederatedPotential, what: str) -> None:
    if pot.local_sites:
        names = [s.name for s in pot.local_sites]
        raise NotImplementedError(
            f"{what} needs per-datum likelihoods of the global sites; the model has "
            f"local latent site(s) {names}, which would have to be integrated out."
        )


def _per_datum_grads(pot: FederatedPotential, theta: jax.Array, arrays: dict):
    """``(J, P, D)`` gradients of each unit's log-likelihood at the flat ``theta``
    (padded entries of ragged nested plates left out)."""
    z = pot.unflatten(theta)

    def one(row: dict, nested: dict) -> jax.Array:
        batch = {k: v[None] for k, v in row.items()}
        grad = jax.grad(pot.silo_log_likelihood)(z, {}, batch, None, nested)
        return pot.flatten(grad)

    def silo(rows: dict, nested: dict) -> jax.Array:
        return jax.vmap(one, in_axes=(0, None))(rows, nested)

    return jax.vmap(silo)(arrays, pot.nested)


def _thetas(thetas: Any, dim: int) -> jax.Array:
    thetas = jnp.asarray(thetas)
    if thetas.ndim != 2 or thetas.shape[1] != dim:
        raise ValueError(
            f"thetas must be (G, {dim}) flattened unconstrained global positions; got "
            f"shape {thetas.shape}."
        )
    return thetas


def _grid_statistic(
    model: Callable, data: Any, thetas: Any, stat: Callable, what: str
) -> jax.Array:
    pot = federated_potential(model, data)
    _global_only(pot, what)
    thetas = _thetas(thetas, pot.global_dim)
    mask = jnp.asarray(data.mask)
    sizes = jnp.sum(mask, 1)
    arrays = dict(data.arrays)

    def at(theta: jax.Array) -> jax.Array:
        g = _per_datum_grads(pot, theta, arrays)
        g = jnp.where(mask[..., None], g, 0.0)  # padded units count for nothing
        return stat(theta, g, mask, sizes)

    # one theta at a time: the (J, P, D) gradients of a whole grid need not fit at once
    return jax.lax.map(jax.jit(at), thetas, batch_size=16).T


def epsilon_squared(
    model: Callable, data: Any, surrogates: GaussianNat, thetas: Any
) -> jax.Array:
    r"""
    Lemma 2's statistic on a grid: for each silo :math:`s` and point :math:`\theta`,

    .. math::

        \epsilon_s^2(\theta) = \frac{1}{N_s} \sum_{x_i \in x_s}
        \Big\| \nabla \log p(x_i \mid \theta) - \frac{1}{N_s} \nabla \log q_s(\theta)
        \Big\|^2 ,

    whose maximum over :math:`\theta` is the :math:`\epsilon_s^2` of FSGLD's error
    bound (Theorem 2). With :math:`q_s` the exact likelihood it is the within-silo
    spread of the per-datum gradients.

    :param callable model: a federated model without local latent sites.
    :param FederatedData data: the silos' data.
    :param GaussianNat surrogates: the :math:`q_s`, stacked by silo.
    :param thetas: ``(G, D)`` flattened unconstrained global positions.
    :return: ``(J, G)`` values.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> from numpyro_fed.sgld_diagnostics import epsilon_squared
        >>> def model(x):
        ...     theta = numpyro.sample("theta", dist.Normal(0, 1))
        ...     with nf.silo_plate("data", x.shape[0]):
        ...         numpyro.sample("x", dist.Normal(theta, 1), obs=x)
        >>> data = nf.FederatedData.from_groups([0, 0, 1], x=jnp.array([0.0, 2, 5]))
        >>> q = nf.expfam.GaussianNat(
        ...     h=jnp.array([[2.0], [5.0]]), prec=jnp.array([[2.0], [1.0]])
        ... )
        >>> epsilon_squared(model, data, q, jnp.array([[0.0], [3.0]])).tolist()
        [[1.0, 1.0], [0.0, 0.0]]
    """
    pot = federated_potential(model, data)
    check_surrogates(surrogates, data.num_silos, pot.global_dim)
    s = jax.tree.map(jnp.asarray, surrogates)

    def stat(theta, g, mask, sizes):
        own = grad_log_density(s, theta) / sizes[:, None]  # (J, D)
        sq = jnp.sum((g - own[:, None]) ** 2, -1)
        return jnp.sum(jnp.where(mask, sq, 0.0), 1) / sizes

    return _grid_statistic(model, data, thetas, stat, "epsilon_squared")


def gamma_squared(
    model: Callable, data: Any, thetas: Any, reduce: str = "mean"
) -> jax.Array:
    r"""
    Assumption 1's statistic on a grid: for each silo :math:`s` and point
    :math:`\theta`, the squared per-datum gradient norm
    :math:`\|\nabla \log p(x_i \mid \theta)\|^2` averaged over the silo's data
    (``reduce="mean"``, the authors' Figure 4 code) or its maximum (``"max"``, the
    bound :math:`\gamma_s^2` of Assumption 1). Its maximum over :math:`\theta` enters
    DSGLD's error bound (Theorem 1) where :math:`\epsilon_s^2` enters FSGLD's.

    :param callable model: a federated model without local latent sites.
    :param FederatedData data: the silos' data.
    :param thetas: ``(G, D)`` flattened unconstrained global positions.
    :param str reduce: ``"mean"`` or ``"max"`` over the silo's data.
    :return: ``(J, G)`` values.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> from numpyro_fed.sgld_diagnostics import gamma_squared
        >>> def model(x):
        ...     theta = numpyro.sample("theta", dist.Normal(0, 1))
        ...     with nf.silo_plate("data", x.shape[0]):
        ...         numpyro.sample("x", dist.Normal(theta, 1), obs=x)
        >>> data = nf.FederatedData.from_groups([0, 0, 1], x=jnp.array([0.0, 2, 5]))
        >>> gamma_squared(model, data, jnp.array([[0.0]]), reduce="max").tolist()
        [[4.0], [25.0]]
    """
    if reduce not in ("mean", "max"):
        raise ValueError(f"reduce must be 'mean' or 'max', got {reduce!r}.")

    def stat(theta, g, mask, sizes):
        sq = jnp.sum(g**2, -1)
        if reduce == "max":
            return jnp.max(jnp.where(mask, sq, -jnp.inf), 1)
        return jnp.sum(jnp.where(mask, sq, 0.0), 1) / sizes

    return _grid_statistic(model, data, thetas, stat, "gamma_squared")


def gradient_variance(kernel: Any, data: Any, theta: Any) -> GradientVariance:
    r"""
    The exact mean and covariance trace of the kernel's gradient estimator at a
    point (or at each point of a grid), over the silo choice and the minibatch (seed 001 spec §2.5): with
    :math:`G_s = \nabla \log p(x_s \mid \theta)`, :math:`W_s` the mean squared
    deviation of the silo's per-datum gradients from :math:`G_s / N_s`, and the
    conducive term :math:`c_s = \alpha g_s(\theta)`,

    .. math::

        \mathrm{tr}\,\mathrm{Cov}[\psi] = \sum_s \frac{1}{f_s} \frac{N_s^2}{m}
        \kappa_s W_s + \sum_s f_s \Big\| \frac{G_s}{f_s} + c_s - G \Big\|^2,

    where :math:`\kappa_s = 1` with replacement and :math:`(N_s - m)/(N_s - 1)`
    without. Comparing a DSGLD kernel on the silos with one on the pooled data (one
    silo: plain SGLD) gives the variance ratio of Figure 1.

    :param kernel: an :class:`~numpyro_fed.FSGLD` or :class:`~numpyro_fed.DSGLD`.
    :param FederatedData data: the silos' data.
    :param theta: the flattened unconstrained global position ``(D,)``, or ``(G, D)``
        positions (each field then gets a leading axis of size ``G``).
    :rtype: GradientVariance

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> from numpyro_fed.sgld_diagnostics import gradient_variance
        >>> def model(x):
        ...     theta = numpyro.sample("theta", dist.Normal(0, 1))
        ...     with nf.silo_plate("data", x.shape[0]):
        ...         numpyro.sample("x", dist.Normal(theta, 1), obs=x)
        >>> data = nf.FederatedData.from_groups([0, 0, 1, 1], x=jnp.array([0.0, 2, 4, 6]))
        >>> v = gradient_variance(nf.DSGLD(model, 1e-3), data, jnp.zeros(1))
        >>> float(v.mean[0]), float(v.within), float(v.between)  # full batches
        (12.0, 0.0, 64.0)
    """
    pot, cfg = kernel.potential(data), kernel.config(data)
    _global_only(pot, "gradient_variance")
    theta = jnp.asarray(theta)
    one = theta.ndim == 1
    thetas = _thetas(theta[None] if one else theta, pot.global_dim)
    mask = jnp.asarray(data.mask)
    arrays = dict(data.arrays)
    n = jnp.sum(mask, 1).astype(thetas.dtype)
    f = cfg.silo_probs

    def at(theta: jax.Array) -> GradientVariance:
        g = _per_datum_grads(pot, theta, arrays)
        g = jnp.where(mask[..., None], g, 0.0)
        g_silo = jnp.sum(g, 1)  # G_s
        g_all = jnp.sum(g_silo, 0)
        prior = pot.flatten(jax.grad(pot.log_prior)(pot.unflatten(theta)))
        if cfg.batch_size is None:
            within = jnp.zeros((), theta.dtype)
        else:
            m = cfg.batch_size
            spread = jnp.sum((g - (g_silo / n[:, None])[:, None]) ** 2, -1)
            w = jnp.sum(jnp.where(mask, spread, 0.0), 1) / n  # W_s
            kappa = 1.0 if cfg.replace else (n - m) / jnp.maximum(n - 1, 1)
            within = jnp.sum(n**2 / m * kappa * w / f)
        drift = g_silo / f[:, None]
        if cfg.conducive is not None:
            drift = drift + grad_log_density(cfg.conducive, theta)  # + alpha g_s
        between = jnp.sum(f * jnp.sum((drift - g_all) ** 2, -1))
        return GradientVariance(prior + g_all, within, between, within + between)

    out = jax.jit(jax.vmap(at))(thetas)
    return jax.tree.map(lambda x: x[0], out) if one else out


def mean_error_curves(draws: Any, reference_mean: Any) -> MeanErrorCurves:
    r"""
    Both errors of the posterior-mean estimate against the number of draws
    (Figure 3b): the text's :math:`\|\hat\mu_t - \bar\mu\|^2` and the notebook's
    running mean of :math:`\|\theta_t - \bar\mu\|`.

    :param draws: ``(T, ...)`` draws of one site (or a flattened position), in order.
    :param reference_mean: the exact posterior mean, shaped like one draw.
    :rtype: MeanErrorCurves

    **Example:**

    .. doctest::

        >>> import numpy as np
        >>> from numpyro_fed.sgld_diagnostics import mean_error_curves
        >>> c = mean_error_curves(np.array([[1.0, 0.0], [-1.0, 0.0]]), np.zeros(2))
        >>> c.squared_error.tolist(), c.mean_distance.tolist()
        ([1.0, 0.0], [1.0, 1.0])
    """
    draws = np.asarray(draws, dtype=float)
    ref = np.asarray(reference_mean, dtype=float)
    if draws.ndim < 1 or draws.shape[1:] != ref.shape:
        raise ValueError(
            f"draws must be (T,) + the reference's shape {ref.shape}; got {draws.shape}."
        )
    dev = (draws - ref).reshape(draws.shape[0], -1)
    t = np.arange(1, draws.shape[0] + 1)
    running = np.cumsum(dev, 0) / t[:, None]
    distance = np.cumsum(np.linalg.norm(dev, axis=1)) / t
    return MeanErrorCurves(np.sum(running**2, 1), distance)


def warn_diverged(
    name: str,
    state: Any,
    step_size: Callable,
    *,
    chains: bool = True,
    seen: set | None = None,
) -> bool:
    """
    Warn (a ``RuntimeWarning``, on the host) naming each chain of a kernel's state
    that has left finite values: the step it did (0-based: draw ``t`` of a run from
    step 0 is the first non-finite one), its silo and step size, so a chain never
    turns to NaN silently (its draws still show the NaNs, as NumPyro's do). The
    kernels record that step in their state
    (:class:`~numpyro_fed.infer.mcmc.SGLDState`'s ``diverged_at`` and
    ``diverged_silo``) rather than report it from the compiled loop
    (:meth:`~numpyro_fed.infer.mcmc.FSGLD.warn_divergence` says where this runs).

    :param str name: the kernel's name, for the message.
    :param state: one chain's state, or chains stacked along the leading axis.
    :param callable step_size: the kernel's schedule ``t -> h_t``.
    :param bool chains: name the chains by index (``False``: one chain whose index
        the caller does not know, as in NumPyro's sequential chains).
    :param set seen: leave out the ``(chain, step, silo)`` in it, and add those
        warned of.
    :return: whether it warned.
    """
    at = np.atleast_1d(np.asarray(state.diverged_at))
    silo = np.atleast_1d(np.asarray(state.diverged_silo))
    went = [int(c) for c in np.flatnonzero(at >= 0)]
    if seen is not None:
        went = [c for c in went if (c, int(at[c]), int(silo[c])) not in seen]
        seen.update((c, int(at[c]), int(silo[c])) for c in went)
    if not went:
        return False
    where = ", ".join(
        (f"chain {c} at step " if chains else "at step ")
        + f"{at[c]} on silo {silo[c]} (step size "
        + f"{float(step_size(jnp.asarray(at[c], jnp.int32))):.3g})"
        for c in went
    )
    warnings.warn(
        f"{name}: the Langevin step diverged to non-finite values: {where}; the "
        "chain's later draws are NaN. Lower step_size; for FSGLD, bound the "
        "conducive gradient (conducive_radius, default 4). Where a global scale sets "
        "the spread of local sites (a funnel, as in a centred hierarchy), "
        "non-centre the model (numpyro.infer.reparam.LocScaleReparam): the "
        "curvature grows without bound toward the funnel's neck, beyond any fixed "
        "step size.",
        RuntimeWarning,
        stacklevel=3,
    )
    return True
