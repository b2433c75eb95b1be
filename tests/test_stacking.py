# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The vectorized set-up of FederatedData gives exactly what the straightforward
silo-by-silo construction (one scan of the rows and one ``np.pad`` per silo) gives."""

import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_fed.data import FederatedData
from numpyro_fed.stacking import group_rows, unit_ids


def _reference_pad(x, shape):
    widths = [(0, t - s) for s, t in zip(x.shape, shape, strict=True)]
    if x.dtype == np.bool_:
        return np.pad(x, widths)
    x = np.pad(x, [(0, 0)] + widths[1:], mode="edge")
    return np.concatenate([x, np.repeat(x[:1], shape[0] - x.shape[0], axis=0)])


def _reference_silos(silos, rows, pad_to=None):
    """Everything FederatedData holds, built one silo at a time."""
    names = tuple(silos[0])
    sizes = tuple(len(r) for r in rows)
    units = max(max(sizes), pad_to or 0)
    arrays = {}
    for k in names:
        parts = [np.asarray(s[k]) for s in silos]
        dtype = np.result_type(*parts)
        tail = tuple(np.max([p.shape[1:] for p in parts], axis=0).tolist())
        padded = [_reference_pad(p.astype(dtype), (units, *tail)) for p in parts]
        arrays[k] = np.stack(padded)
    ids = np.full((len(silos), units), -1, np.int32)
    for j, r in enumerate(rows):
        ids[j, : len(r)] = r
    shapes = tuple(tuple(np.shape(s[k]) for k in names) for s in silos)
    return {"arrays": arrays, "ids": ids, "sizes": sizes, "shapes": shapes}


def _reference_groups(groups, pad_to=None, **arrays):
    groups = np.asarray(groups)
    rows = [np.flatnonzero(groups == g) for g in np.unique(groups)]
    silos = [{k: np.asarray(v)[r] for k, v in arrays.items()} for r in rows]
    return _reference_silos(silos, rows, pad_to)


def _assert_identical(data, expected):
    assert data.sizes == expected["sizes"]
    assert data.num_units == sum(expected["sizes"])
    assert data.names == tuple(expected["arrays"])
    assert tuple(tuple(s.values()) for s in data.silo_shapes) == expected["shapes"]
    # Python ints in the static shapes, as before (they are pytree aux data).
    assert all(type(n) is int for s in data.silo_shapes for v in s.values() for n in v)
    for k, v in expected["arrays"].items():
        assert data.arrays[k].dtype == jnp.asarray(v).dtype, k
        np.testing.assert_array_equal(np.asarray(data.arrays[k]), v, err_msg=k)
    np.testing.assert_array_equal(np.asarray(data.unit_ids), expected["ids"])
    np.testing.assert_array_equal(np.asarray(data.mask), expected["ids"] >= 0)
    assert data.unit_ids.dtype == jnp.int32 and data.mask.dtype == jnp.bool_
    # The pytree aux data (compared by jit caches) agree with the reference.
    sizes, names, shapes, num_units, _ = data.tree_flatten()[1]
    assert (sizes, names, shapes, num_units) == (
        expected["sizes"],
        tuple(expected["arrays"]),
        expected["shapes"],
        sum(expected["sizes"]),
    )


def _ragged_groups(labels_kind, seed):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(1, 6, size=7)  # silos of 1 to 5 units
    codes = rng.permutation(np.repeat(np.arange(7), sizes))
    if labels_kind == "int":
        labels = np.array([3, 10, 0, 7, 42, 5, 1])[codes]
    elif labels_kind == "str":
        labels = np.array(["b", "aa", "a", "z", "B", "ab", "c"])[codes]
    else:
        labels = np.array([0.5, 2.0, 0.0, 1.25, 9.0, 3.0, 7.5])[codes]
    n = len(codes)
    arrays = {
        "y": rng.normal(size=n),
        "k": rng.integers(-5, 5, size=n).astype(np.int16),
        "X": rng.normal(size=(n, 3, 2)).astype(np.float32),
        "m": rng.random(size=(n, 4)) < 0.5,
        "e": np.ones((n, 0)),
    }
    return labels, arrays


@pytest.mark.parametrize("pad_to", [None, 9], ids=["tight", "pad_to"])
@pytest.mark.parametrize("labels_kind", ["int", "str", "float"])
@pytest.mark.parametrize("seed", [0, 1])
def test_from_groups_matches_reference(labels_kind, seed, pad_to):
    labels, arrays = _ragged_groups(labels_kind, seed)
    assert not np.all(labels[:-1] <= labels[1:])  # the labels are unsorted
    data = FederatedData.from_groups(labels, pad_to=pad_to, **arrays)
    expected = _reference_groups(labels, pad_to, **arrays)
    assert len(set(expected["sizes"])) > 1  # ragged
    _assert_identical(data, expected)


@pytest.mark.parametrize("ragged", [False, True], ids=["uniform", "ragged-nested"])
def test_from_silos_matches_reference(ragged):
    rng = np.random.default_rng(3)
    silos = []
    for j, n in enumerate([2, 5, 1, 3]):
        width = 2 + (j % 3 if ragged else 0)
        silos.append(
            {
                "y": rng.normal(size=(n, width)),
                "obs": rng.random(size=(n, width)) < 0.6,
                "c": rng.integers(0, 3, size=n).astype(np.int32 if j else np.int64),
            }
        )
    ends = np.cumsum([0] + [len(s["c"]) for s in silos])
    rows = [np.arange(a, b) for a, b in zip(ends[:-1], ends[1:], strict=True)]
    for pad_to in (None, 7):
        data = FederatedData.from_silos(silos, pad_to=pad_to)
        _assert_identical(data, _reference_silos(silos, rows, pad_to))
        assert data.arrays["c"].dtype == jnp.asarray(np.int64(0)).dtype  # promoted


def test_group_rows_one_argsort():
    labels = np.array(["b", "a", "b", "c", "a", "b"])
    uniq, order, sizes = group_rows(labels)
    assert uniq.tolist() == ["a", "b", "c"]
    assert order.tolist() == [1, 4, 0, 2, 5, 3]  # each silo's rows in input order
    assert sizes.tolist() == [2, 3, 1]
    ids = unit_ids(sizes, 4, order)
    assert ids.tolist() == [[1, 4, -1, -1], [0, 2, 5, -1], [3, -1, -1, -1]]


def test_errors_name_the_first_bad_silo():
    """The vectorized checks name the silo (and array) the silo-by-silo checks
    named: the first silo, in label order, with a bad entry."""
    labels = np.array([2, 0, 1, 1, 2, 0])
    y = np.array([np.nan, 0.0, np.inf, np.nan, np.nan, 1.0])
    z = np.array([0.0, 0.0, 0.0, 0.0, 0.0, np.nan])
    with pytest.raises(ValueError, match=r"'z' of silo 0 \(label 0\) has 1 non-"):
        FederatedData.from_groups(labels, y=y, z=z)
    with pytest.raises(ValueError, match=r"'y' of silo 1 \(label 1\) has 2 non-"):
        FederatedData.from_groups(labels, y=y)
    with pytest.raises(ValueError, match=r"'s' of silo 0 \(label 0\) is not numeric"):
        FederatedData.from_groups(labels, y=y, s=np.array(list("abcdef")))
    small = r"^silo 1 \(label 3\) holds 1; silo 2 \(label 4\) holds 2 unit"
    with pytest.raises(ValueError, match=small):
        FederatedData.from_groups([4, 0, 0, 0, 4, 3], min_silo_size=3, z=z)
