# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Checking, grouping and padding the silos' arrays into the stacked ``(J, P, ...)``
layout of :class:`~numpyro_fed.FederatedData`.

Everything here is vectorized over silos: grouping ``N`` rows into ``J`` silos is one
stable argsort (``O(N log N)``) and padding them is one gather, so a million one-unit
silos are set up in seconds. Only arrays ragged along a nested axis across silos,
which come one silo at a time from :meth:`~numpyro_fed.FederatedData.from_silos`,
are padded silo by silo.
"""

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

__all__ = [
    "check_min_silo_size",
    "check_rows",
    "check_silo",
    "group_rows",
    "pad_silo",
    "stack_rows",
    "unit_ids",
]


def check_silo(silo: Mapping[str, Any], where: str) -> dict[str, np.ndarray]:
    """One silo's arrays as numpy, validated.

    :param dict silo: name -> array, units along axis 0.
    :param str where: how the errors name the silo (``"silo 3"``).
    """
    arrays = {name: np.asarray(value) for name, value in silo.items()}
    if not arrays:
        raise ValueError(f"{where} has no arrays.")
    for name, x in arrays.items():
        if x.ndim == 0:
            raise ValueError(
                f"Array {name!r} of {where} is a scalar: split arrays need the silo "
                "plate as their leading axis (bind constants to the model instead)."
            )
        _check_numeric(name, x, where)
        if x.dtype.kind in "fc" and not np.isfinite(x).all():
            _raise_non_finite(
                name, x.size - int(np.count_nonzero(np.isfinite(x))), where
            )
    lengths = {name: x.shape[0] for name, x in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"Arrays of {where} disagree on the leading axis: {lengths}.")
    if next(iter(lengths.values())) == 0:
        raise ValueError(f"{where} holds no data (0 units along the leading axis).")
    return arrays


def check_rows(
    arrays: dict[str, np.ndarray], silo_of_row: np.ndarray, name: Callable
) -> None:
    """Check pooled arrays as :func:`check_silo` checks each silo's part, naming the
    first silo (and, in it, the first array) that :func:`check_silo` would name.

    :param dict arrays: name -> ``(N, ...)`` array.
    :param silo_of_row: ``(N,)`` silo index of each row.
    :param callable name: ``name(j)`` says how the errors name silo ``j``.
    """
    num_silos = int(silo_of_row.max()) + 1
    first, bad = num_silos, {}
    for k, x in arrays.items():
        if x.dtype.kind not in "biufc":
            first = 0  # every silo's part of it is non-numeric
        elif x.dtype.kind in "fc":
            per_row = (~np.isfinite(x)).reshape(len(x), -1).sum(1)
            if per_row.any():
                bad[k] = np.bincount(silo_of_row, per_row, num_silos).astype(int)
                first = min(first, int(np.flatnonzero(bad[k])[0]))
    if first == num_silos:
        return
    where = name(first)
    for k, x in arrays.items():
        _check_numeric(k, x, where)
        if k in bad and bad[k][first]:
            _raise_non_finite(k, bad[k][first], where)


def _check_numeric(name: str, x: np.ndarray, where: str) -> None:
    if x.dtype.kind not in "biufc":
        raise ValueError(f"Array {name!r} of {where} is not numeric ({x.dtype}).")


def _raise_non_finite(name: str, count: int, where: str) -> None:
    raise ValueError(
        f"Array {name!r} of {where} has {count} non-finite (NaN or inf) entries; "
        "clean or impute them (or drop those units) before federating."
    )


def check_min_silo_size(sizes: np.ndarray, minimum: int | None, name: Callable) -> None:
    """Refuse silos with fewer than ``minimum`` units (``None``: no minimum).

    :param sizes: ``(J,)`` units per silo.
    :param callable name: ``name(j)`` says how the error names silo ``j``.
    """
    if minimum is None:
        return
    if isinstance(minimum, bool) or not isinstance(minimum, (int, np.integer)):
        raise ValueError(f"min_silo_size must be None or an int, got {minimum!r}.")
    small = np.flatnonzero(np.asarray(sizes) < minimum)
    if len(small):
        listed = [f"{name(j)} holds {sizes[j]}" for j in small[:5]]
        raise ValueError(
            f"{'; '.join(listed)}{' ...' if len(small) > 5 else ''} unit(s), below "
            f"min_silo_size={minimum}: its messages would be functions of that few "
            "units' data. Merge small silos or leave them out."
        )


def group_rows(groups: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(labels, order, sizes)``: the sorted unique labels (as :func:`numpy.unique`
    gives them), the rows sorted by label with each silo's rows in their original
    order (a stable argsort), and the number of rows of each label.

    :param groups: ``(N,)`` labels.
    """
    order = np.argsort(groups, kind="stable")
    ordered = groups[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    return ordered[starts], order, np.diff(np.r_[starts, len(groups)])


def unit_ids(sizes: np.ndarray, padded_size: int, rows: np.ndarray) -> np.ndarray:
    """``(J, P)`` int32: silo ``j``'s ``sizes[j]`` consecutive entries of ``rows``
    (the pooled index of each unit), then ``-1`` for the padded slots."""
    silo = np.repeat(np.arange(len(sizes)), sizes)
    slot = np.arange(len(rows)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
    ids = np.full((len(sizes), padded_size), -1, np.int32)
    ids[silo, slot] = rows
    return ids


def stack_rows(x: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Pooled ``(N, ...)`` rows -> ``(J, P, ...)`` by the unit ids: padded slots
    repeat the silo's first unit (False for booleans)."""
    padded = ids < 0
    out = x[np.where(padded, ids[:, :1], ids)]
    if x.dtype == np.bool_:
        out[padded] = False
    return out


def pad_silo(x: np.ndarray, shape: tuple[int, ...], name: str, silo: int) -> np.ndarray:
    """Pad one silo's ``x`` to ``shape``: False for booleans, else the edge along
    nested axes and the silo's first unit along the unit axis."""
    widths = [(0, t - s) for s, t in zip(x.shape, shape, strict=True)]
    if x.dtype == np.bool_:
        return np.pad(x, widths)
    try:
        x = np.pad(x, [(0, 0)] + widths[1:], mode="edge")
    except ValueError as error:
        raise ValueError(
            f"Array {name!r} of silo {silo} has an empty nested axis to pad: shape "
            f"{x.shape}, padded to {shape}."
        ) from error
    return np.concatenate([x, np.repeat(x[:1], shape[0] - x.shape[0], axis=0)])
