# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Checks of what a user passes in, shared by the driver, the kernels, the
surrogates and the data classes. They run at the boundary, outside ``jit``, and
name the argument, array, silo or state field at fault."""

import math
import operator
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

__all__ = [
    "RUNTIMES",
    "check_count",
    "check_federated_state",
    "check_finite_array",
    "check_optimizer",
    "check_participating",
    "check_runtime_options",
    "check_state_layout",
]

#: The driver's runtimes (:class:`~numpyro_fed.infer.driver.Driver`).
RUNTIMES = ("simulate", "sequential", "events", "sharded")


def check_count(name: str, value: Any, minimum: int = 1) -> int:
    """
        ``value`` as a Python ``int``: any integer (Python, NumPy or a concrete JAX
        scalar) of at least ``minimum``; booleans and floats are refused.

        :param str name: the argument's name, for the error.
        :param value: the count.
        :param int minimum: the smallest value allowed.
        :return: ``int(value)``.
        :raises TypeError: for a value that is not an integer, naming the argument.
        :raises ValueError: for an integer below ``minimum``, naming the argument.

        **Example:**

        .. doctest::

            >>> import numpy as np
            >>> from numpyro_fed.checks import check_count
            >>> check_count("num_steps", np.int64(10))
            10
            >>> check_count("num_steps", 2.5)
            Traceback (most recent call last):
            ...
            TypeError: num_steps must be an int >= 1, got 2.5.
    """
    message = f"{name} must be an int >= {minimum}, got {value!r}."
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        count = operator.index(value)
    except TypeError:
        raise TypeError(message) from None
    if count < minimum:
        raise ValueError(message)
    return int(count)


def check_participating(participating: Any, num_silos: int) -> jax.Array:
    """
    A participation mask as ``(num_silos,)`` booleans: booleans, or integers and
    floats that are all 0 or 1. A traced mask (inside a user's ``jit``) is checked
    for its shape and dtype only.

    :param participating: the mask, one entry per silo.
    :param int num_silos: the number of silos of the data.
    :return: the mask as a boolean ``jax.Array``.
    :raises ValueError: for another shape or values other than 0 and 1.
    """
    if isinstance(participating, jax.core.Tracer):
        shape, values = participating.shape, None
        ok_dtype = participating.dtype == np.bool_
    else:
        values = np.asarray(participating)
        shape = values.shape
        ok_dtype = values.dtype == np.bool_ or (
            values.dtype.kind in "iuf" and np.isin(values, (0, 1)).all()
        )
    if shape != (num_silos,):
        raise ValueError(
            f"participating must hold one boolean per silo: the data hold {num_silos} "
            f"silos, so its shape must be ({num_silos},); got {shape}."
        )
    if not ok_dtype:
        shown = "a traced non-boolean array" if values is None else values.tolist()
        raise ValueError(
            f"participating must be booleans (or 0/1) naming the silos that take "
            f"part; got {shown}."
        )
    return jnp.asarray(participating, bool)


def check_finite_array(name: str, value: Any, where: str) -> None:
    """
    Raise unless the floating array ``value`` is finite.

    :param str name: the array's name.
    :param value: the array.
    :param str where: its holder, e.g. ``"party 'a'"``.
    :raises ValueError: naming the array, its holder and the first bad row.
    """
    x = np.asarray(value)
    if x.dtype.kind not in "fc":
        return
    bad = ~np.isfinite(x)
    if bad.any():
        rows = (
            np.flatnonzero(bad.reshape(len(x), -1).any(1))
            if x.ndim
            else np.zeros(0, np.intp)
        )
        at = f" (first at row {int(rows[0])})" if len(rows) else ""
        raise ValueError(
            f"Array {name!r} of {where} has {int(bad.sum())} non-finite (NaN or inf) "
            f"entries{at}; clean or impute them (or drop those rows) before "
            "federating."
        )


def _dtype(x: Any) -> Any:
    return x.dtype if hasattr(x, "dtype") else np.result_type(x)


def check_state_layout(
    owner: str,
    state: Any,
    expected: Any,
    fix: str,
    *,
    dtypes: bool = True,
    root: str = "state",
) -> None:
    """
    Raise unless ``state`` has the fields, shapes and dtypes of ``expected`` (the
    state that the owner would build for the data at hand, e.g. by
    :func:`jax.eval_shape` of its ``init``): a state of another data layout would
    otherwise fail deep inside the round, or run on misaligned silos.

    :param str owner: who checks (a class name), for the error.
    :param state: the state passed in.
    :param expected: the expected state, leaves with ``shape`` and ``dtype``.
    :param str fix: what to do instead, appended to the error.
    :param bool dtypes: compare dtypes too (else shapes only).
    :param str root: the name of ``state`` in the error (fields follow it).
    :raises ValueError: naming the first field that differs.
    """

    def field(path: tuple) -> str:
        return root + jax.tree_util.keystr(path)

    got, got_tree = jax.tree_util.tree_flatten_with_path(state)
    want, want_tree = jax.tree_util.tree_flatten_with_path(expected)
    # jaxlib ships its _jax extension without stubs, so mypy cannot see
    # PyTreeDef.__ne__.
    if got_tree != want_tree:  # type: ignore[operator]
        have = {field(p) for p, _ in got}
        need = {field(p) for p, _ in want}
        missing, extra = sorted(need - have), sorted(have - need)
        detail = (
            f"missing {missing[:4]}, unexpected {extra[:4]}"
            if missing or extra
            else f"structure {got_tree} where {want_tree} is needed"
        )
        raise ValueError(
            f"{owner}: the state does not have the fields this model and data need "
            f"({detail}): it was made by another algorithm, model or guide; {fix}."
        )
    for (path, x), (_, e) in zip(got, want, strict=True):
        shape, dtype = tuple(np.shape(x)), _dtype(x)
        if shape != tuple(e.shape) or (dtypes and dtype != e.dtype):
            wanted = f"{tuple(e.shape)} ({e.dtype})" if dtypes else f"{tuple(e.shape)}"
            raise ValueError(
                f"{owner}: {field(path)} has shape {shape} ({dtype}) but this data "
                f"layout needs {wanted}: the state was made for data of another "
                f"layout (number of silos or rows, padded units, array shapes); {fix}."
            )


def check_federated_state(
    owner: str, state: Any, num_silos: int, expected_of: Callable, fix: str
) -> None:
    """
    Raise unless ``state`` is a driver's state (``server``, ``silos``, ``rng_key``)
    of ``num_silos`` silos with the layout of ``expected_of(state.rng_key)``.

    :param str owner: who checks (a class name), for the error.
    :param state: the state passed in.
    :param int num_silos: the number of silos of the data.
    :param callable expected_of: ``rng_key -> expected state`` (leaves with
        ``shape`` and ``dtype``), called only for a state of ``num_silos`` silos.
    :param str fix: what to do instead, appended to the error.
    :raises TypeError: for an object that is not a driver's state.
    :raises ValueError: naming the silo counts, or the first field that differs.
    """
    if not all(hasattr(state, f) for f in ("server", "silos", "rng_key")):
        raise TypeError(
            f"{owner} needs the FederatedState of init or of a run (result.state); "
            f"got {type(state).__name__}."
        )
    held = {np.shape(x)[0] for x in jax.tree.leaves(state.silos) if np.ndim(x)}
    if held and held != {num_silos}:
        raise ValueError(
            f"{owner}: the state holds {min(held)} silos but the data hold "
            f"{num_silos}; {fix}."
        )
    check_state_layout(owner, state, expected_of(state.rng_key), fix)


def check_runtime_options(
    runtime: str,
    participation: float,
    order: str,
    staleness: Any,
    max_rejected: float | None,
) -> int:
    """Check the driver's runtime options; return ``max_staleness`` as an int."""
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}.")
    if not 0 < participation <= 1:
        raise ValueError(f"participation must be in (0, 1], got {participation!r}.")
    if order not in ("cyclic", "random"):
        raise ValueError(f"order must be 'cyclic' or 'random', got {order!r}.")
    if max_rejected is not None and not 0 <= max_rejected <= 1:
        raise ValueError(f"max_rejected must be in [0, 1], got {max_rejected!r}.")
    return check_count("max_staleness", staleness, minimum=0)


def check_optimizer(name: str, optim: Any) -> None:
    """Raise unless ``optim`` is an optax transformation."""
    if not isinstance(optim, optax.GradientTransformation):
        raise TypeError(
            f"{name} must be an optax.GradientTransformation such as optax.adam(1e-2);"
            f" got {type(optim).__name__}."
        )
    # A NaN or negative learning rate runs, and returns NaNs or parameters that
    # never move: one step on a unit gradient shows it before any work.
    x = jnp.ones((1,))
    try:
        update = optim.update(x, optim.init(x), x)[0]
    except Exception:  # an optimizer that needs more than (grads, state, params)
        return
    update = float(jnp.ravel(update)[0])
    if not math.isfinite(update):
        raise ValueError(
            f"{name} gives a non-finite update ({update}) for a unit gradient: is its "
            "learning rate NaN or infinite?"
        )
    if update > 0:
        raise ValueError(
            f"{name} steps up a unit gradient (update {update:+.3g}): optax "
            "minimizes, so its learning rate must be positive."
        )
