# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Gaussian densities in the families' factored form
:math:`\\Sigma = \\mathrm{diag}(\\sigma) L L^\\top \\mathrm{diag}(\\sigma)`, with
:math:`L` unit lower-triangular, written so that no covariance is ever formed."""

import jax
import jax.numpy as jnp
from jax.scipy.linalg import solve_triangular
import numpy as np

__all__ = [
    "cholesky_factor",
    "gaussian_log_density",
    "gaussian_log_density_terms",
    "unit_tril",
]

_LOG_2PI = float(np.log(2 * np.pi))


def unit_tril(raw: jax.Array) -> jax.Array:
    """The unit lower-triangular matrix of the free entries ``raw`` (strict lower
    triangle kept, ones on the diagonal, upper triangle ignored)."""
    return jnp.tril(raw, -1) + jnp.eye(raw.shape[-1], dtype=raw.dtype)


def gaussian_log_density_terms(
    z: jax.Array, loc: jax.Array, scale: jax.Array, tril: jax.Array | None
) -> jax.Array:
    """Per-coordinate terms of :math:`\\log N(z; \\mu, \\Sigma)`: term ``i`` depends
    on coordinates ``<= i`` only (the chain rule), so a sum over a leading block is
    that block's marginal density.

    :param jax.Array z: the point, ``(..., n)``.
    :param jax.Array loc: :math:`\\mu`.
    :param jax.Array scale: :math:`\\sigma`, positive.
    :param tril: the free entries of :math:`L` (``(n, n)``), or ``None`` for
        :math:`L = I`.
    """
    white = (z - loc) / scale
    if tril is not None:
        white = solve_triangular(unit_tril(tril), white, lower=True, unit_diagonal=True)
    return -0.5 * _LOG_2PI - jnp.log(scale) - 0.5 * white**2


def gaussian_log_density(
    z: jax.Array,
    loc: jax.Array,
    scale: jax.Array,
    tril: jax.Array | None,
    mask: jax.Array | None = None,
) -> jax.Array:
    """:math:`\\log N(z; \\mu, \\Sigma)`; with ``mask``, the sum of the chain-rule
    terms (:func:`gaussian_log_density_terms`) where it is True."""
    terms = gaussian_log_density_terms(z, loc, scale, tril)
    if mask is not None:
        terms = jnp.where(mask, terms, 0.0)
    return jnp.sum(terms, -1)


def cholesky_factor(scale: jax.Array, tril: jax.Array | None) -> jax.Array:
    """:math:`\\mathrm{diag}(\\sigma) L`, the lower Cholesky factor of
    :math:`\\Sigma` (diagonal :math:`\\mathrm{diag}(\\sigma)` when ``tril`` is
    ``None``); batched over leading axes of ``scale`` and ``tril``."""
    if tril is None:
        return scale[..., :, None] * jnp.eye(scale.shape[-1], dtype=scale.dtype)
    return scale[..., :, None] * unit_tril(tril)
