# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Bounds on FSGLD's and DSGLD's moves: the check of a step-size schedule, and the
bound of the conducive gradient far from where the surrogates were fitted.

The conducive gradient :math:`b_s - A_s \\theta` is linear in the position, so far
from the mean :math:`\\bar\\theta` of :math:`q = \\prod_s q_s = \\mathcal
N(\\bar\\theta, \\Lambda^{-1})` it outgrows a likelihood whose curvature fades
(a scale that widens the other sites' spread, as in a funnel; a saturating link)
and pushes the chain away. Evaluating every silo's term at the same point
:math:`\\theta_c`, the position pulled back onto the ellipsoid
:math:`\\|\\theta_c - \\bar\\theta\\|_\\Lambda \\le r`
(:func:`bounded_position`), keeps :math:`\\sum_s f_s g_s = 0` exactly, so the
estimator stays unbiased (as for any surrogates); inside the ellipsoid, where the
surrogates describe the silos, the term is unchanged, and outside it the term stays
what it is on the ellipsoid's surface.
"""

import math
import numbers
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.expfam import GaussianNat
from numpyro_fed.util import rmatvec

__all__ = [
    "ConduciveBound",
    "bounded_position",
    "check_step_size",
    "conducive_bound",
]


class ConduciveBound(NamedTuple):
    """Where the conducive gradient stops growing.

    - **center** - :math:`\\bar\\theta`, the mean of :math:`q = \\prod_s q_s`.
    - **root** - :math:`R^\\top` with :math:`\\Lambda = R R^\\top` (``(D, D)``), or
      :math:`\\sqrt{\\Lambda}` for a diagonal :math:`\\Lambda` (``(D,)``).
    - **radius** - :math:`r`, in standard deviations of :math:`q` (Mahalanobis).
    """

    center: jax.Array
    root: jax.Array
    radius: float


#: The steps at which a step-size schedule is checked: every one of the first
#: thousand, then a geometric grid up to 1e9 (a schedule that turns NaN or negative
#: late in a long run would otherwise poison the chain silently).
_SCHEDULE_PROBES = np.unique(
    np.concatenate([np.arange(1001), np.geomspace(1000, 1e9, 200).astype(np.int64)])
)


def check_step_size(step_size: Any) -> Callable:
    """``step_size`` as a schedule ``t -> h_t``: a positive finite float, or a
    callable that is positive and finite at every probed step (else a
    ``ValueError`` naming the first bad step)."""
    if callable(step_size):
        probes = _SCHEDULE_PROBES
        try:
            h = np.asarray(jax.vmap(step_size)(jnp.asarray(probes, jnp.int32)))
        except Exception:  # a schedule with Python control flow: a few steps
            probes = probes[:: len(probes) // 20]
            h = np.array([float(step_size(jnp.asarray(t, jnp.int32))) for t in probes])
        bad = np.flatnonzero(~(np.isfinite(h) & (h > 0)))
        if bad.size:
            t0 = int(probes[bad[0]])
            raise ValueError(
                f"step_size(t) must be positive and finite at every step; at t={t0} "
                f"it is {float(h[bad[0]])}."
            )
        return step_size
    real = isinstance(step_size, numbers.Real) and not isinstance(step_size, bool)
    value = float(step_size) if real else math.nan  # numpy's scalars are Real
    if not (math.isfinite(value) and value > 0):
        raise ValueError(
            "step_size must be a positive finite number or a callable t -> h_t, got "
            f"{step_size!r}."
        )
    return lambda t: jnp.asarray(value)


def _product(surrogates: GaussianNat) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(surrogates.h).sum(0), np.asarray(surrogates.prec).sum(0)


def conducive_bound(surrogates: GaussianNat, radius: float) -> ConduciveBound:
    """
    The ellipsoid of :math:`q = \\prod_s q_s` of Mahalanobis radius ``radius``.

    :param GaussianNat surrogates: the :math:`q_s`, stacked by silo.
    :param float radius: :math:`r > 0`.
    :rtype: ConduciveBound
    """
    if not radius > 0:
        raise ValueError(f"conducive_radius must be positive, got {radius!r}.")
    h, prec = _product(surrogates)
    if prec.ndim == 1:
        return ConduciveBound(jnp.asarray(h / prec), jnp.asarray(np.sqrt(prec)), radius)
    center = np.linalg.solve(prec, h)
    root = np.linalg.cholesky(0.5 * (prec + prec.T))
    return ConduciveBound(jnp.asarray(center), jnp.asarray(root), float(radius))


def bounded_position(bound: ConduciveBound, theta: jax.Array) -> jax.Array:
    """``theta`` pulled back along the ray from :math:`\\bar\\theta` onto the
    ellipsoid :math:`\\|\\theta_c - \\bar\\theta\\|_\\Lambda \\le r` (unchanged
    inside it)."""
    offset = theta - bound.center
    whitened = (
        bound.root * offset if bound.root.ndim == 1 else rmatvec(bound.root, offset)
    )
    distance = jnp.sqrt(jnp.sum(whitened**2))
    return bound.center + jnp.minimum(1.0, bound.radius / distance) * offset
