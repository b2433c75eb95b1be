# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Federated data: per-silo arrays stacked along a leading silo axis, and splitters.

A silo holds a subset of the indices of the silo plate; every split array has that
plate's axis first. For simulation, silos are padded to a common number of units ``P``
(repeating the silo's first unit, so padded values stay inside every support) and
stacked, so one :func:`jax.vmap` steps all silos; ``mask`` says which units are real.
"""

from collections.abc import Mapping, Sequence
from functools import partial
import operator
from typing import Any

import jax
import jax.numpy as jnp
from jax.tree_util import register_pytree_node_class
import numpy as np

from numpyro_fed.stacking import (
    check_min_silo_size,
    check_rows,
    check_silo,
    group_rows,
    pad_silo,
    stack_rows,
    unit_ids,
)

__all__ = ["FederatedData", "split_dirichlet", "split_iid", "split_label_skew"]

_MAX_DIRICHLET_ATTEMPTS = 1000


class _StaticIds:
    """The ``(J, P)`` unit ids as hashable pytree aux data, with the static numpy
    indices of gather/scatter (so both work on traced arrays under jit and vmap)."""

    def __init__(self, ids: np.ndarray) -> None:
        self.ids = ids
        self._hash = hash((ids.shape, ids.tobytes()))
        silo, slot = np.nonzero(ids >= 0)
        order = np.argsort(ids[silo, slot])
        self.gather = (silo[order], slot[order])  # pooled unit -> (silo, slot)
        self.scatter = np.where(ids >= 0, ids, ids[:, :1])  # slot -> pooled unit

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _StaticIds)
            and self.ids.shape == other.ids.shape
            and (bool(np.array_equal(self.ids, other.ids)))
        )


# One compiled op per view (eager jnp indexing would compile ~10 primitives each).
@partial(jax.jit, static_argnums=(1, 2))
def _index(x: jax.Array, ids: "_StaticIds", which: str) -> jax.Array:
    return x[getattr(ids, which)]


# One compiled program per silo shape, whatever the silo index.
@partial(jax.jit, static_argnums=2)
def _unpad(arrays: tuple, j: jax.Array, shapes: tuple) -> tuple:
    return tuple(
        x[(j, *(slice(0, n) for n in shape))]
        for x, shape in zip(arrays, shapes, strict=True)
    )


@register_pytree_node_class
class FederatedData:
    """
    The silos' arrays, padded to ``P`` units and stacked along a leading silo axis.

    Build it with :meth:`from_groups` or :meth:`from_silos`. It is a JAX pytree with
    leaves ``arrays``, ``mask`` and ``unit_ids`` (sizes, names and shapes are static),
    so it passes through ``jax.jit`` and ``jax.vmap``.

    - **arrays** - dict name -> ``(J, P, ...)`` array; padded units repeat the silo's
      first unit (boolean arrays are padded with False).
    - **mask** - ``(J, P)`` booleans, True for real units.
    - **unit_ids** - ``(J, P)`` int32 index of each unit in the pooled order (-1:
      padding).

    **Example:**

    .. doctest::

        >>> import numpy as np
        >>> import numpyro_fed as nf
        >>> data = nf.FederatedData.from_groups(["b", "a", "b"], y=np.array([1, 2, 3]))
        >>> data
        FederatedData(num_silos=2, sizes=(1, 2), padded_size=2, names=('y',))
        >>> data.arrays["y"].tolist(), data.mask.tolist(), data.unit_ids.tolist()
        ([[2, 2], [1, 3]], [[True, False], [True, True]], [[1, -1], [0, 2]])
        >>> data.silo(1)["y"].tolist(), data.pooled()["y"].tolist()
        ([1, 3], [1, 2, 3])
        >>> stacked = data.scatter_units(np.array([10, 20, 30]))
        >>> stacked.tolist(), data.gather_units(stacked).tolist()
        ([[20, 20], [10, 30]], [10, 20, 30])
    """

    def __init__(self, arrays: dict, mask: jax.Array, ids: jax.Array, static: tuple):
        # Build with from_groups / from_silos; ``static`` is the pytree aux data.
        self.arrays = arrays
        self.mask = mask
        self.unit_ids = ids
        self._sizes, self._names, self._shapes, self._num_units, self._ids = static

    def tree_flatten(self) -> tuple[tuple, tuple]:
        static = (self._sizes, self._names, self._shapes, self._num_units, self._ids)
        return (self.arrays, self.mask, self.unit_ids), static

    @classmethod
    def tree_unflatten(cls, static: tuple, children: tuple) -> "FederatedData":
        arrays, mask, ids = children
        return cls(arrays, mask, ids, static)

    @classmethod
    def from_groups(
        cls,
        group_ids: Sequence[Any] | np.ndarray,
        /,
        *,
        pad_to: int | None = None,
        min_silo_size: int | None = None,
        **arrays: Any,
    ) -> "FederatedData":
        """
        Split arrays along their leading axis (the silo plate's axis) by group label:
        silos are the sorted unique labels, silo ``j`` keeps its rows in their
        original order, ``unit_ids`` are the original row indices, and :meth:`pooled`
        gives back the input arrays exactly.

        :param group_ids: one silo label (int >= 0 or str) per index of the plate.
        :param int pad_to: pad every silo to at least this many units.
        :param int min_silo_size: refuse a silo with fewer units (default: no
            minimum); a silo's messages are functions of its units' data, of one
            unit's alone for a one-unit silo (``docs/privacy.md``).
        :param arrays: the model's data arrays (numpy or JAX), by argument name.
        :rtype: FederatedData

        **Example:**

        .. doctest::

            >>> import numpy as np
            >>> import numpyro_fed as nf
            >>> data = nf.FederatedData.from_groups([1, 0, 1], pad_to=3, y=np.arange(3))
            >>> data.sizes, data.padded_size, data.silo(1)["y"].tolist()
            ((1, 2), 3, [0, 2])
        """
        groups = np.asarray(group_ids)
        if groups.ndim != 1 or len(groups) == 0:
            raise ValueError(f"group_ids must be non-empty and 1-D: {groups.shape}.")
        if groups.dtype.kind in "if" and not (groups >= 0).all():
            raise ValueError(
                f"group_ids has {int((~(groups >= 0)).sum())} negative or NaN labels: "
                "every unit must belong to a silo (drop unwanted units first)."
            )
        if not arrays:
            raise ValueError("from_groups needs at least one array (e.g. y=y).")
        for name, value in arrays.items():
            n = np.shape(value)[:1]
            what = f"has {n[0]} entries along its leading axis" if n else "is a scalar"
            if n != (len(groups),):
                raise ValueError(
                    f"Array {name!r} {what} but group_ids has {len(groups)} (split "
                    "arrays need the silo plate as their leading axis)."
                )
        arrays = {name: np.asarray(value) for name, value in arrays.items()}
        labels, order, sizes = group_rows(groups)

        def silo_name(j: int) -> str:
            return f"silo {j} (label {labels[j].item()!r})"

        check_min_silo_size(sizes, min_silo_size, silo_name)
        silo_of_row = np.empty(len(groups), np.intp)
        silo_of_row[order] = np.repeat(np.arange(len(sizes)), sizes)
        check_rows(arrays, silo_of_row, silo_name)
        ids = unit_ids(sizes, _padded_size(sizes, pad_to), order)
        stacked = {k: stack_rows(v, ids) for k, v in arrays.items()}
        # One shapes tuple per distinct silo size, shared by the silos of that size.
        shared = {
            n: tuple((n, *v.shape[1:]) for v in arrays.values())
            for n in set(sizes.tolist())
        }
        return cls._finish(stacked, ids, tuple(shared[n] for n in sizes.tolist()))

    @classmethod
    def from_silos(
        cls,
        silos: Sequence[Mapping[str, Any]],
        /,
        *,
        pad_to: int | None = None,
        min_silo_size: int | None = None,
    ) -> "FederatedData":
        """
        Stack per-silo arrays, each in the model's layout (units along axis 0).

        Silos may differ in size and arrays may be ragged along nested axes too (one
        county per silo, each with its own number of homes): every axis is padded to
        its maximum over silos, repeating edge values (False for boolean arrays). The
        federated algorithms mask the padded entries of every site inside a nested
        plate (:func:`~numpyro_fed.partition.nested_sizes`), so the model needs no
        mask of its own. Units are numbered in concatenation order.

        :param list silos: one dict name -> array per silo, all with the same names.
        :param int pad_to: pad every silo to at least this many units.
        :param int min_silo_size: refuse a silo with fewer units (default: no
            minimum), as in :meth:`from_groups`.
        :rtype: FederatedData

        **Example:**

        .. doctest::

            >>> import numpy as np
            >>> import numpyro_fed as nf
            >>> data = nf.FederatedData.from_silos(
            ...     [{"y": np.ones((2, 3)), "m": np.ones((2, 3), bool)},
            ...      {"y": np.ones((1, 2)), "m": np.ones((1, 2), bool)}])
            >>> data.arrays["y"].shape, data.arrays["m"][1].tolist()
            ((2, 2, 3), [[True, True, False], [False, False, False]])
        """
        if len(silos) < 1:
            raise ValueError("from_silos needs at least one silo, got none.")
        names = list(silos[0])
        checked = []
        for j, silo in enumerate(silos):
            if not isinstance(silo, Mapping):
                raise ValueError(f"Silo {j} must be a dict of arrays: {type(silo)}")
            missing = [k for k in names if k not in silo]
            extra = [k for k in silo if k not in names]
            if missing or extra:
                raise ValueError(
                    f"Silo {j} has different arrays from silo 0: missing {missing}, "
                    f"extra {extra}."
                )
            checked.append(check_silo({k: silo[k] for k in names}, f"silo {j}"))
        sizes = np.array([len(s[names[0]]) for s in checked])
        check_min_silo_size(sizes, min_silo_size, lambda j: f"silo {j}")
        ids = unit_ids(sizes, _padded_size(sizes, pad_to), np.arange(sizes.sum()))
        stacked = {}
        for k in names:
            parts = [s[k] for s in checked]
            if len({(p.ndim, p.dtype == np.bool_) for p in parts}) > 1:
                raise ValueError(
                    f"Array {k!r} differs across silos in its number of axes or in "
                    f"being boolean: {[(p.shape, str(p.dtype)) for p in parts]}."
                )
            dtype = np.result_type(*parts)
            tails = {p.shape[1:] for p in parts}
            if len(tails) == 1:  # the common case: one gather, no per-silo loop
                pooled = np.concatenate([p.astype(dtype, copy=False) for p in parts])
                stacked[k] = stack_rows(pooled, ids)
            else:
                shape = (ids.shape[1], *np.max(list(tails), axis=0).tolist())
                stacked[k] = np.stack(
                    [
                        pad_silo(p.astype(dtype), shape, k, j)
                        for j, p in enumerate(parts)
                    ]
                )
        shapes = tuple(tuple(s[k].shape for k in names) for s in checked)
        return cls._finish(stacked, ids, shapes)

    @classmethod
    def _finish(cls, stacked: dict, ids: np.ndarray, shapes: tuple) -> "FederatedData":
        """The data from the stacked numpy arrays, the ``(J, P)`` unit ids and each
        silo's own array shapes."""
        sizes = tuple(np.count_nonzero(ids >= 0, axis=1).tolist())
        static = (sizes, tuple(stacked), shapes, sum(sizes), _StaticIds(ids))
        arrays = {k: jnp.asarray(v) for k, v in stacked.items()}
        return cls(arrays, jnp.asarray(ids >= 0), jnp.asarray(ids), static)

    @property
    def num_silos(self) -> int:
        """``J``, the number of silos."""
        return len(self._sizes)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Number of real units in each silo."""
        return self._sizes

    @property
    def num_units(self) -> int:
        """``N``, units in the pooled data (the sum of :attr:`sizes`)."""
        return self._num_units

    @property
    def padded_size(self) -> int:
        """``P``, units per silo after padding."""
        return int(self._ids.ids.shape[1])

    @property
    def names(self) -> tuple[str, ...]:
        """Names of the arrays."""
        return self._names

    def __repr__(self) -> str:
        return (
            f"FederatedData(num_silos={self.num_silos}, sizes={self.sizes}, "
            f"padded_size={self.padded_size}, names={self.names})"
        )

    @property
    def silo_shapes(self) -> tuple[dict[str, tuple[int, ...]], ...]:
        """Each silo's own (unpadded) array shapes, by name."""
        return tuple(dict(zip(self._names, s, strict=True)) for s in self._shapes)

    @property
    def ragged(self) -> tuple[str, ...]:
        """Names of the arrays whose nested (non-unit) axes differ across silos."""
        return tuple(
            k
            for i, k in enumerate(self._names)
            if len({shapes[i][1:] for shapes in self._shapes}) > 1
        )

    def silo(self, j: int) -> dict[str, jax.Array]:
        """
        Silo ``j``'s own arrays, unpadded (original shapes, nested extents included).

        :param int j: silo index (negative counts from the end).
        """
        j = operator.index(j)
        if not -self.num_silos <= j < self.num_silos:
            raise IndexError(f"silo {j} is out of range for {self.num_silos} silos.")
        j = j % self.num_silos
        arrays = tuple(self.arrays[k] for k in self._names)
        return dict(zip(self._names, _unpad(arrays, j, self._shapes[j]), strict=True))

    def pooled(self) -> dict[str, jax.Array]:
        """All silos' real units in pooled order (for NUTS or centralized SVI).

        :raises ValueError: for arrays ragged along a nested axis with no boolean
            array among them: the pooled layout pads them, and an unedited model would
            count the padding (give the model a boolean mask array, or use
            :meth:`silo` to reach each silo's own arrays).
        """
        ragged = self.ragged
        if ragged and not any(self.arrays[k].dtype == jnp.bool_ for k in self._names):
            raise ValueError(
                f"Array(s) {list(ragged)} are ragged along a nested axis across silos, "
                "so their pooled layout is padded there and a model run on it would "
                "count the padding. Pass a boolean mask array (padded False) that the "
                "pooled model applies, or use data.silo(j) for each silo's own arrays."
            )
        return self.gather_units(dict(self.arrays))

    def gather_units(self, stacked: Any) -> Any:
        """Stacked ``(J, P, ...)`` arrays (any pytree of them) -> pooled ``(N, ...)``
        (see the class example)."""
        shape = self._ids.ids.shape

        def gather(x: Any) -> jax.Array:
            x = jnp.asarray(x)
            if x.shape[:2] != shape:
                raise ValueError(
                    f"gather_units expects leading axes (num_silos, padded_size) = "
                    f"{shape}, got an array of shape {x.shape}."
                )
            return _index(x, self._ids, "gather")

        return jax.tree.map(gather, stacked)

    def scatter_units(self, pooled: Any) -> Any:
        """Pooled ``(N, ...)`` arrays (any pytree of them) -> stacked ``(J, P, ...)``,
        inverse of :meth:`gather_units`; padded slots repeat the silo's first unit."""

        def scatter(x: Any) -> jax.Array:
            x = jnp.asarray(x)
            if x.ndim == 0 or x.shape[0] != self.num_units:
                raise ValueError(
                    f"scatter_units expects a leading axis of num_units="
                    f"{self.num_units}, got an array of shape {x.shape}."
                )
            return _index(x, self._ids, "scatter")

        return jax.tree.map(scatter, pooled)


def _padded_size(sizes: np.ndarray, pad_to: int | None) -> int:
    """``P``: the largest silo's size, or ``pad_to`` when larger."""
    units = int(sizes.max())
    if pad_to is not None and pad_to < units:
        raise ValueError(f"pad_to={pad_to} is below the largest silo ({units}).")
    return max(units, int(pad_to or 0))


def _labels(labels: Sequence[Any] | np.ndarray, num_silos: int) -> np.ndarray:
    _check_num_silos(num_silos)
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) < num_silos:
        raise ValueError(
            f"labels must be 1-D with at least num_silos={num_silos} entries, got "
            f"shape {labels.shape}."
        )
    return labels


def _check_num_silos(num_silos: int) -> None:
    if not isinstance(num_silos, (int, np.integer)) or num_silos < 1:
        raise ValueError(f"num_silos must be a positive integer, got {num_silos!r}.")


def split_iid(
    num_units: int, num_silos: int, *, sizes: Sequence[int] | None = None, seed: int = 0
) -> np.ndarray:
    """
    Random split of ``num_units`` units into silos of sizes as equal as possible, or
    of the given ``sizes`` (e.g. ``[300, 237]``), which must sum to ``num_units``.

    :param int num_units: ``N``, the size of the silo plate.
    :param int num_silos: ``J``.
    :param sizes: optional explicit silo sizes.
    :param int seed: seed of :func:`numpy.random.default_rng`.
    :return: one silo id per unit, for :meth:`FederatedData.from_groups`.

    **Example:**

    .. doctest::

        >>> import numpy as np
        >>> import numpyro_fed as nf
        >>> np.bincount(nf.data.split_iid(537, 2, sizes=[300, 237])).tolist()
        [300, 237]
    """
    _check_num_silos(num_silos)
    if sizes is None:
        if num_units < num_silos:
            raise ValueError(f"num_units={num_units} cannot fill {num_silos} silos.")
        base, extra = divmod(num_units, num_silos)
        sizes = [base + (j < extra) for j in range(num_silos)]
    sizes = [int(s) for s in sizes]
    if len(sizes) != num_silos or min(sizes) < 1 or sum(sizes) != num_units:
        raise ValueError(
            f"sizes={sizes} must be {num_silos} positive counts summing to "
            f"num_units={num_units} (they sum to {sum(sizes)})."
        )
    ids = np.repeat(np.arange(num_silos), sizes)
    return np.random.default_rng(seed).permutation(ids)


def split_label_skew(
    labels: Sequence[Any] | np.ndarray,
    num_silos: int,
    dominant: float = 0.9,
    *,
    seed: int = 0,
) -> np.ndarray:
    """
    Label-skewed split of Hassan et al. (SFVI): silos of equal size
    ``n = N // num_silos``; in silo ``j`` a fraction ``dominant`` of the units carry
    label ``classes[j % num_classes]`` and the rest are spread uniformly over the
    other labels, sampled without replacement. When a label runs out the silo is
    filled from the remaining units, and the ``N % num_silos`` leftover units go
    round-robin, so the dominant share is approximately ``dominant``.

    :param labels: one class label per unit.
    :param int num_silos: ``J``.
    :param float dominant: share of each silo's dominant label, in ``[0, 1]``.
    :param int seed: seed of :func:`numpy.random.default_rng`.
    :return: one silo id per unit (every unit is assigned).

    **Example:**

    .. doctest::

        >>> import numpy as np
        >>> import numpyro_fed as nf
        >>> ids = nf.data.split_label_skew(np.repeat([0, 1], 50), 2, dominant=0.8)
        >>> np.bincount(ids).tolist(), int(np.sum(ids[:50] == 0))
        ([50, 50], 40)
    """
    labels = _labels(labels, num_silos)
    if not 0.0 <= dominant <= 1.0:
        raise ValueError(f"dominant must be in [0, 1], got {dominant}.")
    rng = np.random.default_rng(seed)
    codes = np.unique(labels, return_inverse=True)[1].reshape(-1)
    num_classes = int(codes.max()) + 1
    size = len(labels) // num_silos
    quota = np.zeros((num_silos, num_classes), int)
    for j in range(num_silos):
        main = j % num_classes
        others = np.delete(np.arange(num_classes), main)
        quota[j, main] = round(dominant * size) if len(others) else size
        if len(others):
            base, extra = divmod(size - quota[j, main], len(others))
            quota[j, others] = base
            quota[j, rng.choice(others, extra, replace=False)] += 1
    pools = [rng.permutation(np.flatnonzero(codes == c)) for c in range(num_classes)]
    used = np.zeros(num_classes, int)
    ids = np.full(len(labels), -1, np.int64)
    # Dominant labels first, so their share is exact whenever the data allow it.
    mains = [(j, j % num_classes) for j in range(num_silos)]
    rest = [(j, c) for j in range(num_silos) for c in range(num_classes)]
    for j, c in mains + [(j, c) for j, c in rest if c != j % num_classes]:
        rows = pools[c][used[c] : used[c] + quota[j, c]]
        used[c] += len(rows)
        ids[rows] = j
    free = rng.permutation(np.flatnonzero(ids < 0))
    short = size - np.bincount(ids[ids >= 0], minlength=num_silos)
    ids[free[: short.sum()]] = np.repeat(np.arange(num_silos), short)
    leftover = free[short.sum() :]
    ids[leftover] = np.arange(len(leftover)) % num_silos
    return ids


def split_dirichlet(
    labels: Sequence[Any] | np.ndarray,
    num_silos: int,
    alpha: float,
    *,
    seed: int = 0,
    min_size: int = 1,
) -> np.ndarray:
    """
    Dirichlet label split: each class's units are shared among silos with
    proportions drawn from ``Dirichlet(alpha, ..., alpha)``, redrawn until every
    silo holds at least ``min_size`` units (small ``alpha``: strong label skew).

    :param labels: one class label per unit.
    :param int num_silos: ``J``.
    :param float alpha: Dirichlet concentration (> 0).
    :param int seed: seed of :func:`numpy.random.default_rng`.
    :param int min_size: minimum number of units per silo.
    :return: one silo id per unit.

    **Example:**

    .. doctest::

        >>> import numpy as np
        >>> import numpyro_fed as nf
        >>> ids = nf.data.split_dirichlet(np.arange(100) % 4, 3, alpha=0.5, seed=1)
        >>> len(ids), bool(np.bincount(ids, minlength=3).min() >= 1)
        (100, True)
    """
    labels = _labels(labels, num_silos)
    if not alpha > 0:
        raise ValueError(f"alpha must be positive, got {alpha}.")
    if min_size * num_silos > len(labels):
        raise ValueError(
            f"{len(labels)} units cannot give each of {num_silos} silos "
            f"min_size={min_size} units."
        )
    rng = np.random.default_rng(seed)
    codes = np.unique(labels, return_inverse=True)[1].reshape(-1)
    by_class = [np.flatnonzero(codes == c) for c in range(int(codes.max()) + 1)]
    for _ in range(_MAX_DIRICHLET_ATTEMPTS):
        ids = np.empty(len(labels), np.int64)
        for rows in by_class:
            rows = rng.permutation(rows)
            shares = np.cumsum(rng.dirichlet(np.full(num_silos, float(alpha))))[:-1]
            cuts = np.round(shares * len(rows)).astype(int)
            for j, part in enumerate(np.split(rows, cuts)):
                ids[part] = j
        if np.bincount(ids, minlength=num_silos).min() >= min_size:
            return ids
    raise ValueError(
        f"No Dirichlet(alpha={alpha}) draw in {_MAX_DIRICHLET_ATTEMPTS} attempts gave "
        f"each of {num_silos} silos at least min_size={min_size} units; raise alpha, "
        "or lower num_silos or min_size."
    )
