# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Server-side aggregation rules: pure, jit-able, silo axis first.

Every rule takes values stacked along a leading silo axis (and optional weights) and
returns ``(value, diagnostics)``, as ott-jax's ``Bures.barycenter`` does.

The Gaussian 2-Wasserstein barycenter (Hassan et al. §3.7, after Álvarez-Esteban et
al. 2016 and Mallasto & Feragen 2017) has mean :math:`\\sum_j w_j \\mu_j` and the
covariance that solves

.. math::

    \\Sigma_\\star = \\sum_j w_j \\big(\\Sigma_\\star^{1/2} \\Sigma_j
    \\Sigma_\\star^{1/2}\\big)^{1/2},

which the fixed point
:math:`S \\leftarrow S^{-1/2} \\big(\\sum_j w_j (S^{1/2}\\Sigma_j S^{1/2})^{1/2}\\big)^2
S^{-1/2}` reaches from :math:`S_0 = \\sum_j w_j \\Sigma_j`. For diagonal covariances it
has the closed form :math:`\\sigma_\\star = \\sum_j w_j \\sigma_j`.

Two backends compute the full-covariance barycenter (:func:`w2_barycenter_fn`): ours,
:func:`w2_barycenter` (eigendecomposition square roots, stops on a tolerance), and
ott-jax's :meth:`ott.geometry.costs.Bures.barycenter` through
:func:`w2_barycenter_ott` (Newton-Schulz square roots, a fixed number of iterations;
ott-jax is the optional ``diagnostics`` extra). They agree to about 1e-13 in float64.
"""

from typing import Any, Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

__all__ = [
    "BARYCENTER_BACKENDS",
    "BarycenterInfo",
    "cov_to_scale_tril",
    "scale_tril_to_cov",
    "w2_barycenter",
    "w2_barycenter_diag",
    "w2_barycenter_fn",
    "w2_barycenter_ott",
    "weighted_mean",
]

#: Names accepted by :func:`w2_barycenter_fn` (and ``barycenter=`` of SFVI-Avg).
BARYCENTER_BACKENDS = ("fixed_point", "ott")


class BarycenterInfo(NamedTuple):
    """- **num_iterations** - fixed-point iterations taken.
    - **residual** - max-abs change of the covariance in the last iteration.
    """

    num_iterations: jax.Array
    residual: jax.Array


def _weights(num: int, weights: jax.Array | None, dtype) -> jax.Array:
    if weights is None:
        return jnp.full((num,), 1.0 / num, dtype)
    weights = jnp.asarray(weights, dtype)
    return weights / jnp.sum(weights)


def weighted_mean(stacked, weights: jax.Array | None = None):
    """Weighted average over the leading (silo) axis of every leaf of a pytree
    (unweighted by default, as SFVI-Avg averages :math:`\\theta`)."""
    leaves = jax.tree.leaves(stacked)
    w = _weights(leaves[0].shape[0], weights, leaves[0].dtype)
    return jax.tree.map(lambda x: jnp.tensordot(w, x, axes=1), stacked)


def w2_barycenter_diag(locs, scales, weights=None):
    """
    W2 barycenter of Gaussians with diagonal covariances: average the means and
    the standard deviations.

    :param jax.Array locs: ``(J, d)`` means.
    :param jax.Array scales: ``(J, d)`` standard deviations.
    :param jax.Array weights: optional ``(J,)`` weights (normalised here).
    :return: ``((loc, scale), info)``; exact, so ``info`` reports 0 iterations.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_fed.aggregate import w2_barycenter_diag
        >>> (loc, scale), _ = w2_barycenter_diag(jnp.array([[0.0], [2.0]]),
        ...                                      jnp.array([[1.0], [3.0]]))
        >>> float(loc[0]), float(scale[0])
        (1.0, 2.0)
    """
    w = _weights(locs.shape[0], weights, locs.dtype)
    info = BarycenterInfo(jnp.array(0), jnp.zeros((), locs.dtype))
    return (w @ locs, w @ scales), info


def _sym_sqrt_and_inv_sqrt(matrix):
    values, vectors = jnp.linalg.eigh(0.5 * (matrix + matrix.T))
    values = jnp.clip(values, jnp.finfo(matrix.dtype).tiny)
    root = jnp.sqrt(values)
    sqrt = (vectors * root) @ vectors.T
    inv_sqrt = (vectors / root) @ vectors.T
    return sqrt, inv_sqrt


def _sym_sqrt(matrix):
    return _sym_sqrt_and_inv_sqrt(matrix)[0]


def w2_barycenter(locs, covs, weights=None, *, tol=None, max_iterations=200):
    """
    W2 barycenter of Gaussians with full covariances by the fixed-point iteration
    of Álvarez-Esteban et al. (2016).

    :param jax.Array locs: ``(J, d)`` means.
    :param jax.Array covs: ``(J, d, d)`` covariances (positive definite).
    :param jax.Array weights: optional ``(J,)`` weights (normalised here).
    :param float tol: stop when no covariance entry moves by more than ``tol``.
        Default: 64 machine epsilons of the covariances' dtype times their largest
        entry. The iteration also stops once it no longer makes progress below
        :math:`\\sqrt{\\epsilon}` of that scale (round-off then bounds the residual:
        in float32 a fixed absolute tolerance such as ``1e-12`` is never reached, and
        each round of SFVI-Avg ran all ``max_iterations``).
    :param int max_iterations: iteration cap.
    :return: ``((loc, cov), BarycenterInfo)``.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_fed.aggregate import w2_barycenter
        >>> covs = jnp.stack([jnp.eye(2), 9 * jnp.eye(2)])
        >>> (loc, cov), info = w2_barycenter(jnp.zeros((2, 2)), covs)
        >>> [round(float(x), 6) for x in jnp.diag(cov)]
        [4.0, 4.0]
    """
    w = _weights(locs.shape[0], weights, locs.dtype)

    def step(cov):
        sqrt, inv_sqrt = _sym_sqrt_and_inv_sqrt(cov)
        inner = jax.vmap(lambda c: _sym_sqrt(sqrt @ c @ sqrt))(covs)
        mean_root = jnp.tensordot(w, inner, axes=1)
        new = inv_sqrt @ mean_root @ mean_root @ inv_sqrt
        return 0.5 * (new + new.T)

    start = jnp.tensordot(w, covs, axes=1)
    eps = jnp.finfo(start.dtype).eps
    scale = jnp.max(jnp.abs(start))
    tol = 64 * eps * scale if tol is None else jnp.asarray(tol, start.dtype)
    floor = jnp.sqrt(eps) * scale

    def cond(carry):
        i, _, residual, previous = carry
        stalled = (residual >= previous) & (residual < floor)
        return (i < max_iterations) & (residual > tol) & ~stalled

    def body(carry):
        i, cov, residual, _ = carry
        new = step(cov)
        return i + 1, new, jnp.max(jnp.abs(new - cov)), residual

    inf = jnp.array(jnp.inf, start.dtype)
    iterations, cov, residual, _ = lax.while_loop(
        cond, body, (jnp.array(0), start, inf, inf)
    )
    return (w @ locs, cov), BarycenterInfo(iterations, residual)


def _ott_bures() -> Any:
    try:
        from ott.geometry.costs import Bures
    except ImportError as err:
        raise ImportError(
            "The 'ott' barycenter backend needs ott-jax: "
            "pip install 'numpyro-fed[diagnostics]'."
        ) from err
    return Bures


def w2_barycenter_ott(
    locs, covs, weights=None, *, num_iterations=50, sqrtm_threshold=None
):
    """
    W2 barycenter of Gaussians with full covariances by ott-jax's
    :meth:`~ott.geometry.costs.Bures.barycenter`, the same fixed point as
    :func:`w2_barycenter` started from the identity, with Newton-Schulz matrix square
    roots. Needs ott-jax (``pip install 'numpyro-fed[diagnostics]'``).

    ott-jax 0.6's ``tolerance`` argument does not stop the loop (its stopping test
    reads an entry not yet written and ends after ``min_iterations``), so this runs
    exactly ``num_iterations`` iterations. The iteration contracts the error by a
    roughly constant factor each time (3 to 10 for covariances with condition
    numbers up to 15), so the default 50 reaches float64 round-off from the identity
    unless the covariances are badly conditioned; ``info.residual`` tells.

    :param jax.Array locs: ``(J, d)`` means.
    :param jax.Array covs: ``(J, d, d)`` covariances (positive definite).
    :param jax.Array weights: optional ``(J,)`` weights (normalised here).
    :param int num_iterations: fixed-point iterations.
    :param float sqrtm_threshold: relative residual at which each Newton-Schulz square
        root stops; default ``100 * eps`` of the dtype (ott-jax's own default,
        1e-6, leaves errors of about 1e-7).
    :return: ``((loc, cov), BarycenterInfo)``; ``residual`` is the Frobenius norm
        of the last change of the covariance (at least its max-abs change).

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_fed.aggregate import w2_barycenter_ott
        >>> covs = jnp.stack([jnp.eye(2), 9 * jnp.eye(2)])
        >>> (loc, cov), info = w2_barycenter_ott(jnp.zeros((2, 2)), covs)
        >>> [round(float(x), 5) for x in jnp.diag(cov)]
        [4.0, 4.0]
    """
    bures = _ott_bures()
    num, dim = locs.shape
    w = _weights(num, weights, locs.dtype)
    if sqrtm_threshold is None:
        sqrtm_threshold = 100 * float(jnp.finfo(locs.dtype).eps)
    xs = jnp.concatenate([locs, jnp.reshape(covs, (num, dim * dim))], axis=1)
    # min = max iterations: ott-jax then runs a scan of exactly that length;
    # inner_iterations=1 so that any count is honoured, not rounded to a multiple.
    x, diffs = bures(dimension=dim).barycenter(
        w,
        xs,
        min_iterations=num_iterations,
        max_iterations=num_iterations,
        inner_iterations=1,
        sqrtm_kw={"threshold": sqrtm_threshold},
    )
    cov = jnp.reshape(x[dim:], (dim, dim))
    # ott-jax reports the squared Frobenius norm of the change divided by d^2.
    residual = jnp.sqrt(jnp.maximum(diffs[-1], 0.0)) * dim
    info = BarycenterInfo(jnp.array(num_iterations), residual.astype(locs.dtype))
    return (x[:dim], 0.5 * (cov + cov.T)), info


def w2_barycenter_fn(backend: str = "fixed_point") -> Callable:
    """
    The full-covariance W2 barycenter of a backend, ``(locs, covs, weights) ->
    ((loc, cov), BarycenterInfo)``.

    :param str backend: ``"fixed_point"`` (:func:`w2_barycenter`, ours) or ``"ott"``
        (:func:`w2_barycenter_ott`; ott-jax is imported now, so a missing install
        fails here rather than inside a jitted step).
    :rtype: callable
    """
    if backend == "fixed_point":
        return w2_barycenter
    if backend == "ott":
        _ott_bures()
        return w2_barycenter_ott
    raise ValueError(
        f"barycenter must be one of {BARYCENTER_BACKENDS}, got {backend!r}."
    )


def cov_to_scale_tril(cov):
    """Split :math:`\\Sigma = K K^\\top` into :math:`(\\sigma, L)` with
    :math:`\\sigma = \\mathrm{diag}(K)` and :math:`L = \\mathrm{diag}(\\sigma)^{-1} K`
    unit lower-triangular, the structured family's global parameterization
    (Hassan et al. §3.7, "mapping back to :math:`\\eta_G`")."""
    factor = jnp.linalg.cholesky(cov)
    scale = jnp.diag(factor)
    return scale, factor / scale[:, None]


def scale_tril_to_cov(scale, tril):
    """:math:`\\Sigma = \\mathrm{diag}(\\sigma) L L^\\top \\mathrm{diag}(\\sigma)`."""
    factor = scale[:, None] * tril
    return factor @ factor.T
