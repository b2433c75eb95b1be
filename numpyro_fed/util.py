# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Small pytree helpers shared by algorithms, runtimes and the driver."""

from typing import Any

import jax
from jax.extend.random import threefry2x32_p
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import biject_to
import optax

__all__ = [
    "all_finite",
    "ascent",
    "constrain",
    "flat_barrier",
    "key_batch_shape",
    "rmatvec",
    "rows_where",
    "stack",
    "take",
    "tree_where",
    "unconstrain",
    "unit_normals",
    "zeros_like_shapes",
]


def all_finite(tree: Any) -> jax.Array:
    """Whether every floating leaf of ``tree`` is finite (a scalar boolean)."""
    # x * 0 is 0 where x is finite and NaN where not, so its sum is finite exactly
    # when every entry is (no overflow). Unlike a reduce_and of isfinite, XLA does
    # not spend seconds constant-folding it over a (silos, ...) broadcast of a
    # constant (a gradient that is zero by structure): a million silos' first
    # round compiled in 30 s with it.
    checks = [
        jnp.isfinite(jnp.sum(x * 0))
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
    """Map unconstrained ``values`` into their sites' ``constraints``. An
    elementwise transform runs on the array as one axis, reshaped back: XLA:CPU
    runs an elementwise fusion over ``(units, 1)`` arrays (one local coordinate a
    unit) in scalar code, several times slower than over the same numbers as
    ``(units,)`` (``benchmarks/xla_cpu_layout.py``)."""

    def one(k, v):
        bijection = biject_to(constraints[k])
        if bijection.domain.event_dim or bijection.codomain.event_dim:
            return bijection(v)
        return bijection(jnp.reshape(v, -1)).reshape(jnp.shape(v))

    return {k: one(k, v) for k, v in values.items()}


def flat_barrier(x: jax.Array) -> jax.Array:
    """``jax.lax.optimization_barrier`` on ``x`` as one axis (for the reason of
    :func:`constrain`: what it materializes is then laid out as a vector)."""
    return jax.lax.optimization_barrier(x.reshape(-1)).reshape(x.shape)


def unconstrain(constraints: dict, values: dict) -> dict:
    """Map constrained ``values`` to unconstrained space."""
    return {k: biject_to(constraints[k]).inv(v) for k, v in values.items()}


def _counter_words(unit_ids: jax.Array, dim: int) -> tuple[jax.Array, jax.Array]:
    """The 64-bit threefry counters ``unit_ids * dim + k``, ``k < dim``, as (high,
    low) 32-bit words: exact for any int32 id and ``dim < 2**16`` (the product
    leaves 32 bits from ``2**32 / dim`` units on)."""
    ids = unit_ids.astype(jnp.uint32)
    k = jnp.arange(dim, dtype=jnp.uint32)
    d = jnp.uint32(dim)
    high, low = (ids >> 16) * d, (ids & 0xFFFF) * d  # each < 2**32
    lo1 = (high << 16) + low
    lo = lo1 + k
    carries = (lo1 < low).astype(jnp.uint32) + (lo < lo1).astype(jnp.uint32)
    return (high >> 16) + carries, lo


def key_batch_shape(key: jax.Array) -> tuple:
    """How many keys ``key`` holds: a typed key array's shape, a raw ``uint32`` key
    array's shape less its last axis (the key's words)."""
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    return key.shape if typed else key.shape[:-1]


def unit_normals(key: jax.Array, unit_ids: jax.Array, dim: int) -> jax.Array:
    """Standard normal rows ``(*unit_ids.shape, dim)``: the row of unit ``u`` is row
    ``u`` of ``jax.random.normal(key, (n, dim))`` for any ``n`` above the largest id,
    so a unit draws the same noise whichever silo holds it, and only the rows asked
    for are drawn (one threefry block an entry, as the pooled draw spends). ``key``
    may also be an array of keys (:func:`key_batch_shape`), one for each index of
    as many leading axes of ``unit_ids`` (one a silo): the same rows as a ``vmap``
    over them, computed on all the entries as one axis (the reason of
    :func:`constrain`).

    The counters and the bits-to-normal map are JAX's own for its default
    (partitionable) threefry: entry ``(u, k)`` is counter ``u * dim + k``. A key of
    another implementation (``"rbg"``) draws each unit from ``fold_in(key, u)``
    under a ``vmap``, as before these counters (JAX does not promise such keys the
    same bits under a ``vmap``, so their draws need not be silo-invariant).

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp
        >>> from numpyro_fed.util import unit_normals
        >>> key = jax.random.key(0)
        >>> rows = unit_normals(key, jnp.array([3, 0]), 2)
        >>> bool(jnp.all(rows == jax.random.normal(key, (4, 2))[jnp.array([3, 0])]))
        True
    """
    dtype = jnp.zeros((), float).dtype
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    words = jax.random.key_data(key) if typed else key
    batch = key_batch_shape(key)
    if words.shape != (*batch, 2):  # not a threefry key: one folded key a unit
        if batch:
            return jax.vmap(unit_normals, in_axes=(0, 0, None))(key, unit_ids, dim)
        return jax.vmap(
            lambda u: jax.random.normal(jax.random.fold_in(key, u), (dim,))
        )(jnp.ravel(unit_ids)).reshape((*jnp.shape(unit_ids), dim))
    shape = (*jnp.shape(unit_ids), dim)
    hi, lo = (
        w.reshape(-1) for w in _counter_words(jnp.asarray(unit_ids)[..., None], dim)
    )
    k1, k2 = (
        jnp.broadcast_to(
            words[..., i].reshape(batch + (1,) * (len(shape) - len(batch))), shape
        ).reshape(-1)
        for i in range(2)
    )
    b1, b2 = threefry2x32_p.bind(k1, k2, hi, lo)
    if dtype == jnp.float64:
        bits = (b1.astype(jnp.uint64) << 32) | b2.astype(jnp.uint64)
    else:
        bits = b1 ^ b2
    finfo = jnp.finfo(dtype)
    uint = bits.dtype
    one = np.array(1.0, dtype).view(uint)
    mantissa = (bits >> np.array(finfo.bits - finfo.nmant, uint)) | one
    floats = jax.lax.bitcast_convert_type(mantissa, dtype) - np.array(1.0, dtype)
    low_end = np.nextafter(np.array(-1.0, dtype), np.array(0.0, dtype))
    u = jnp.maximum(low_end, floats * (np.array(1.0, dtype) - low_end) + low_end)
    return (jnp.sqrt(np.array(2.0, dtype)) * jax.lax.erf_inv(u)).reshape(shape)
