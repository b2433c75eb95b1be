# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Small pytree helpers shared by algorithms, runtimes and the driver."""

from typing import Any

import jax
import jax.numpy as jnp
from numpyro.distributions import biject_to
import optax

__all__ = [
    "all_finite",
    "ascent",
    "constrain",
    "rmatvec",
    "rows_where",
    "stack",
    "take",
    "tree_where",
    "unconstrain",
    "zeros_like_shapes",
]


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating leaf of ``tree`` is finite (a scalar boolean)."""
    checks = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(tree)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return jnp.all(jnp.array(checks)) if checks else jnp.array(True)


#: Up to this size (both sides) :func:`rmatvec` sums scaled rows instead of calling a
#: dot. On XLA's CPU backend a dot is a library call on its own copy of the operand:
#: for a 20 x 20 matrix sliced out of a stack every step, as FSGLD's conducive
#: gradient is, the copy and the call took ~0.15 us (an SGLD step takes ~2.5 us) and
#: the summed rows ~0.04 us; the dot was faster from about 45 on (0.93 vs 1.09 us at
#: 48, 2.5 vs 4.7 us at 100).
RMATVEC_COLUMN_SUM_MAX = 32


def rmatvec(matrix: jax.Array, vector: jax.Array, symmetric: bool = False) -> jax.Array:
    """
    ``matrix^T @ vector`` (scipy's ``rmatvec``), with ``matrix`` of shape
    ``(..., n, m)`` (leading axes batch) and ``vector`` of shape ``(n,)``.

    Up to :data:`RMATVEC_COLUMN_SUM_MAX` it sums the rows of ``matrix`` scaled by
    ``vector`` in one fusion of its own (the barrier keeps XLA from inlining the
    sum, unvectorized, into every element of its consumer), reading a matrix sliced
    out of a stack in place; a dot copies it first. A larger one goes to a dot:
    ``matrix.T @ vector``, or with ``symmetric=True`` (``matrix`` equals its
    transpose, e.g. a precision) ``matrix @ vector``, which reads it as stored.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_fed.util import rmatvec
        >>> rmatvec(jnp.array([[1.0, 2.0], [3.0, 4.0]]), jnp.array([1.0, 10.0])).tolist()
        [31.0, 42.0]
    """
    if max(matrix.shape[-2:]) <= RMATVEC_COLUMN_SUM_MAX:
        return jax.lax.optimization_barrier(jnp.sum(matrix * vector[:, None], -2))
    if symmetric:
        return jnp.einsum("...ij,j->...i", matrix, vector)
    return jnp.swapaxes(matrix, -1, -2) @ vector


def tree_where(ok: jax.Array, new: Any, old: Any) -> Any:
    """``new`` where the scalar ``ok`` holds, else ``old``, leaf by leaf."""
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)


def rows_where(rows: jax.Array, new: Any, old: Any) -> Any:
    """Stacked trees: row j of ``new`` where ``rows[j]``, else row j of ``old``."""

    def pick(n, o):
        return jnp.where(rows.reshape((-1,) + (1,) * (n.ndim - 1)), n, o)

    return jax.tree.map(pick, new, old)


def take(tree: Any, index: Any) -> Any:
    """Row ``index`` of every leaf of a stacked tree."""
    return jax.tree.map(lambda x: x[index], tree)


def stack(trees: list) -> Any:
    """Stack a list of trees of equal structure along a new leading axis."""
    return jax.tree.map(lambda *xs: jnp.stack(xs), *trees)


def zeros_like_shapes(shapes: Any) -> Any:
    """Zeros shaped like the ``jax.ShapeDtypeStruct`` leaves of ``shapes``."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def ascent(
    optimizer: optax.GradientTransformation, grads: Any, optim_state: Any, params: Any
) -> tuple[Any, Any]:
    """One optimizer step *up* the objective whose gradient is ``grads`` (optax
    minimizes, so it is fed the negative gradient)."""
    updates, optim_state = optimizer.update(
        jax.tree.map(jnp.negative, grads), optim_state, params
    )
    return optax.apply_updates(params, updates), optim_state


def constrain(constraints: dict, values: dict) -> dict:
    """Map unconstrained ``values`` into their sites' ``constraints``."""
    return {k: biject_to(constraints[k])(v) for k, v in values.items()}


def unconstrain(constraints: dict, values: dict) -> dict:
    """Map constrained ``values`` to unconstrained space."""
    return {k: biject_to(constraints[k]).inv(v) for k, v in values.items()}
