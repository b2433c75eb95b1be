# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_fed.data import (
    FederatedData,
    split_dirichlet,
    split_iid,
    split_label_skew,
)

N = 11
# All have silo sizes (4, 4, 3) or (11,), which keeps the number of XLA compilations
# (one per new shape in eager mode) and so the test time low.
LABELS = {
    "sorted-ints": np.sort(np.arange(N) % 3),
    "unsorted-ints": np.array([2, 0, 1, 0, 2, 0, 1, 1, 0, 2, 1]),
    "strings": np.array(list("cabacabbacb")),
    "one-silo": np.zeros(N, int),
}


def _arrays(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "y": rng.normal(size=N),
        "counts": rng.integers(1, 9, size=N),
        "obs_mask": rng.random(size=(N, 2)) < 0.7,
        "X": jnp.asarray(rng.normal(size=(N, 3)), dtype=jnp.float32),
    }


def _assert_same(actual, expected):
    """Same values and the dtype JAX gives ``expected`` (computed in numpy, so the
    test itself triggers no XLA compilation)."""
    expected = np.asarray(expected)
    assert actual.dtype == jnp.asarray(expected).dtype
    np.testing.assert_array_equal(np.asarray(actual), expected)


@pytest.mark.parametrize("labels", LABELS.values(), ids=LABELS.keys())
def test_from_groups_round_trip(labels):
    arrays = _arrays()
    data = FederatedData.from_groups(labels, **arrays)
    uniq = np.unique(labels)
    assert data.num_silos == len(uniq)
    assert data.sizes == tuple(int(np.sum(labels == g)) for g in uniq)
    assert data.num_units == N and data.padded_size == max(data.sizes)
    assert data.names == tuple(arrays)
    pooled = data.pooled()
    assert set(pooled) == set(arrays)
    for k, v in arrays.items():
        _assert_same(pooled[k], v)
    for j, g in enumerate(uniq):
        rows = np.flatnonzero(labels == g)
        silo = data.silo(j)
        for k, v in arrays.items():
            _assert_same(silo[k], np.asarray(v)[rows])
        np.testing.assert_array_equal(np.asarray(data.unit_ids)[j, : len(rows)], rows)
    _assert_same(data.silo(-1)["y"], data.silo(data.num_silos - 1)["y"])
    with pytest.raises(IndexError, match="out of range"):
        data.silo(data.num_silos)


def test_padding_repeats_first_unit():
    labels = np.array([1, 0, 1, 1, 0, 1])  # silo 0: rows 1, 4; silo 1: rows 0, 2, 3, 5
    y = np.array([5.0, 6.0, 7.0, 8.0, 9.0, 10.0])
    m = np.array([True, True, False, True, True, True])
    data = FederatedData.from_groups(labels, y=y, m=m)
    np.testing.assert_array_equal(data.arrays["y"], [[6, 9, 6, 6], [5, 7, 8, 10]])
    np.testing.assert_array_equal(
        data.arrays["m"], [[True, True, False, False], [True, False, True, True]]
    )
    np.testing.assert_array_equal(data.mask, [[1, 1, 0, 0], [1, 1, 1, 1]])
    np.testing.assert_array_equal(data.unit_ids, [[1, 4, -1, -1], [0, 2, 3, 5]])
    assert data.mask.dtype == jnp.bool_ and data.unit_ids.dtype == jnp.int32
    assert "num_silos=2" in repr(data) and "sizes=(2, 4)" in repr(data)
    assert "padded_size=4" in repr(data) and "'y'" in repr(data)


@pytest.mark.parametrize("pad_to", [None, 4, 9], ids=["none", "exact", "larger"])
def test_pad_to(pad_to):
    arrays = _arrays()
    labels = LABELS["sorted-ints"]  # sizes (4, 4, 3)
    data = FederatedData.from_groups(labels, pad_to=pad_to, **arrays)
    assert data.padded_size == (pad_to or 4)
    assert data.arrays["X"].shape == (3, pad_to or 4, 3)
    assert int(np.sum(data.mask)) == N
    assert int(np.sum(np.asarray(data.unit_ids) >= 0)) == N
    for k, v in data.pooled().items():
        _assert_same(v, arrays[k])
    np.testing.assert_array_equal(np.asarray(data.arrays["y"])[2, 3:], arrays["y"][8])


@pytest.mark.parametrize("labels", LABELS.values(), ids=LABELS.keys())
def test_gather_scatter_inverse(labels):
    data = FederatedData.from_groups(labels, pad_to=N + 1, y=np.zeros(N))
    rng = np.random.default_rng(1)
    pooled = {"a": rng.normal(size=(N, 2)), "b": np.arange(N)}
    stacked = data.scatter_units(pooled)
    assert stacked["a"].shape == (data.num_silos, N + 1, 2)
    mask, ids = np.asarray(data.mask), np.asarray(data.unit_ids)
    gathered = data.gather_units(stacked)
    for k, v in pooled.items():
        _assert_same(gathered[k], v)
        # real slots hold their unit, padded slots repeat the silo's first unit
        expected = v[np.where(mask, ids, ids[:, :1])]
        _assert_same(stacked[k], expected)
        assert np.array_equal(expected[mask], v[ids[mask]])
    other = rng.normal(size=(data.num_silos, N + 1))
    back = np.asarray(data.scatter_units(data.gather_units(other)))
    np.testing.assert_array_equal(back[mask], other[mask])
    with pytest.raises(ValueError, match="num_silos, padded_size"):
        data.gather_units(jnp.zeros((data.num_silos, N)))
    with pytest.raises(ValueError, match=f"num_units={N}"):
        data.scatter_units(jnp.zeros(N + 1))


def test_from_silos_ragged_units():
    silos = [
        {"y": np.arange(3.0), "X": np.ones((3, 2), np.int32)},
        {"y": np.arange(10.0, 15.0), "X": 2 * np.ones((5, 2), np.int32)},
        {"y": np.array([7.0]), "X": 3 * np.ones((1, 2), np.int32)},
    ]
    data = FederatedData.from_silos(silos)
    assert data.sizes == (3, 5, 1) and data.padded_size == 5 and data.num_units == 9
    np.testing.assert_array_equal(np.asarray(data.unit_ids)[0], [0, 1, 2, -1, -1])
    np.testing.assert_array_equal(np.asarray(data.unit_ids)[2], [8, -1, -1, -1, -1])
    np.testing.assert_array_equal(np.asarray(data.arrays["y"])[2], [7.0] * 5)
    np.testing.assert_array_equal(np.asarray(data.arrays["y"])[0], [0, 1, 2, 0, 0])
    pooled = data.pooled()
    for k in ("y", "X"):
        _assert_same(pooled[k], np.concatenate([s[k] for s in silos]))
    for j, silo in enumerate(silos):
        _assert_same(data.silo(j)["X"], silo["X"])


def test_from_silos_ragged_nested_axis():
    y0, y1 = np.arange(1.0, 16.0).reshape(5, 3), np.arange(20.0, 28.0).reshape(4, 2)
    silos = [
        {"y": y0, "obs": np.ones((5, 3), bool)},
        {"y": y1, "obs": np.array([[1, 1], [1, 0], [1, 1], [0, 1]], bool)},
    ]
    data = FederatedData.from_silos(silos)
    assert data.arrays["y"].shape == (2, 5, 3) and data.arrays["obs"].shape == (2, 5, 3)
    # nested axis: edge values; unit axis: the (nested-padded) first unit
    np.testing.assert_array_equal(np.asarray(data.arrays["y"])[1, 0], [20, 21, 21])
    np.testing.assert_array_equal(np.asarray(data.arrays["y"])[1, 4], [20, 21, 21])
    obs = np.asarray(data.arrays["obs"])[1]
    assert not obs[:, 2].any() and not obs[4].any()
    np.testing.assert_array_equal(obs[:4, :2], silos[1]["obs"])
    for j, silo in enumerate(silos):
        for k, v in data.silo(j).items():
            _assert_same(v, silo[k])
    pooled = data.pooled()
    assert pooled["y"].shape == (9, 3)
    np.testing.assert_array_equal(np.asarray(pooled["y"])[:5], y0)
    np.testing.assert_array_equal(np.asarray(pooled["y"])[5:, :2], y1)
    assert not np.asarray(pooled["obs"])[5:, 2].any()


def test_from_silos_ragged_nested_without_mask():
    """Ragged nested axes need no mask array: the library masks the padding. Only
    the pooled layout, which an unedited model would read padding and all, refuses."""
    silos = [
        {"y": np.ones((5, 3)), "x": np.ones(5)},
        {"y": 2 * np.ones((4, 2)), "x": np.ones(4)},
    ]
    data = FederatedData.from_silos(silos)
    assert data.ragged == ("y",) and data.arrays["y"].shape == (2, 5, 3)
    assert data.silo_shapes == ({"y": (5, 3), "x": (5,)}, {"y": (4, 2), "x": (4,)})
    np.testing.assert_array_equal(np.asarray(data.silo(1)["y"]), silos[1]["y"])
    with pytest.raises(ValueError, match=r"\['y'\].*ragged.*boolean mask"):
        data.pooled()


def test_from_silos_empty_nested_axis_raises():
    silos = [
        {"y": np.ones((2, 0)), "m": np.ones((2, 0), bool)},
        {"y": np.ones((1, 2)), "m": np.ones((1, 2), bool)},
    ]
    with pytest.raises(ValueError, match="'y' of silo 0 has an empty nested axis"):
        FederatedData.from_silos(silos)


def test_pytree_jit_and_vmap():
    arrays = _arrays()
    labels = LABELS["unsorted-ints"]
    data = FederatedData.from_groups(labels, pad_to=5, **arrays)
    leaves, treedef = jax.tree.flatten(data)
    assert len(leaves) == len(arrays) + 2
    rebuilt = jax.tree.unflatten(treedef, leaves)
    assert rebuilt.sizes == data.sizes and rebuilt.padded_size == 5
    _assert_same(rebuilt.pooled()["y"], data.pooled()["y"])

    sums = jax.vmap(lambda d: jnp.sum(jnp.where(d.mask, d.arrays["y"], 0.0)))(data)
    expected = [arrays["y"][labels == g].sum() for g in range(3)]
    np.testing.assert_allclose(sums, expected, rtol=1e-12)

    traces = []

    @jax.jit
    def pooled_sum(d):
        traces.append(1)
        assert d.num_units == N and d.num_silos == 3
        x = d.gather_units(d.arrays["X"])
        return x.sum(0), d.scatter_units(x)

    total, stacked = pooled_sum(data)
    total, stacked = pooled_sum(data)
    assert len(traces) == 1
    np.testing.assert_allclose(total, arrays["X"].sum(0), rtol=1e-12)
    _assert_same(stacked, data.arrays["X"])
    x = np.asarray(data.arrays["X"])
    draws = np.stack([x, 2 * x])  # (S, J, P, 3), as in SFVI's sample_posterior
    _assert_same(jax.vmap(data.gather_units)(draws)[1], 2 * np.asarray(arrays["X"]))


GOOD = {"y": np.ones(4), "x": np.ones((4, 2))}
ERRORS = {
    "length": (
        lambda: FederatedData.from_groups([0, 1, 0, 1, 1], y=np.ones(4)),
        r"'y' has 4 .* group_ids has 5",
    ),
    "scalar": (
        lambda: FederatedData.from_groups([0, 1], y=np.ones(2), s=3.0),
        "'s' is a scalar",
    ),
    "0-d": (
        lambda: FederatedData.from_silos([{"y": np.ones(2), "s": jnp.array(1.0)}]),
        "'s' of silo 0 is a scalar",
    ),
    "no-arrays": (lambda: FederatedData.from_groups([0, 1]), "at least one array"),
    "empty-silo": (
        lambda: FederatedData.from_silos(
            [GOOD, {"y": np.ones(0), "x": np.ones((0, 2))}]
        ),
        "silo 1 holds no data",
    ),
    "no-silos": (lambda: FederatedData.from_silos([]), "at least one silo"),
    "missing-key": (
        lambda: FederatedData.from_silos([GOOD, {"y": np.ones(2)}]),
        r"Silo 1 .*missing \['x'\]",
    ),
    "extra-key": (
        lambda: FederatedData.from_silos([GOOD, {**GOOD, "w": np.ones(4)}]),
        r"Silo 1 .*extra \['w'\]",
    ),
    "leading-axis": (
        lambda: FederatedData.from_silos(
            [GOOD, {"y": np.ones(3), "x": np.ones((2, 2))}]
        ),
        r"silo 1.*'y': 3, 'x': 2",
    ),
    "nan": (
        lambda: FederatedData.from_groups(
            [0, 1, 1, 1], y=np.array([0.0, np.nan, 1.0, np.nan])
        ),
        r"'y' of silo 1 \(label 1\) has 2 non-finite",
    ),
    "inf": (
        lambda: FederatedData.from_silos(
            [GOOD, {"y": np.array([1.0, np.inf]), "x": np.ones((2, 2))}]
        ),
        "'y' of silo 1 has 1 non-finite",
    ),
    "pad_to": (
        lambda: FederatedData.from_groups([0, 0, 0, 1], pad_to=2, y=np.ones(4)),
        r"pad_to=2 .*largest silo \(3\)",
    ),
    "negative-label": (
        lambda: FederatedData.from_groups([0, -1, 1], y=np.ones(3)),
        "1 negative",
    ),
    "ndim-mismatch": (
        lambda: FederatedData.from_silos(
            [GOOD, {"y": np.ones((4, 1)), "x": np.ones((4, 2))}]
        ),
        "'y' differs across",
    ),
    "string-array": (
        lambda: FederatedData.from_groups([0, 1], s=np.array(["a", "b"])),
        "'s' of silo 0 .*not numeric",
    ),
    "iid-silos": (lambda: split_iid(10, 0), "num_silos must be a positive"),
    "iid-negative": (lambda: split_iid(10, -2), "num_silos must be a positive"),
    "iid-sizes": (lambda: split_iid(537, 2, sizes=[300, 236]), "sum to 536"),
    "skew-silos": (lambda: split_label_skew(np.arange(10), 0), "num_silos"),
    "skew-dominant": (lambda: split_label_skew(np.arange(10), 2, 1.5), "dominant"),
    "dirichlet-alpha": (lambda: split_dirichlet(np.arange(10), 2, 0.0), "alpha"),
    "dirichlet-min": (
        lambda: split_dirichlet(np.arange(10), 4, 1.0, min_size=3),
        "min_size=3",
    ),
    "dirichlet-attempts": (
        lambda: split_dirichlet(np.arange(20) % 2, 10, 0.01, min_size=2),
        "1000 attempts",
    ),
}


@pytest.mark.parametrize("make, match", ERRORS.values(), ids=ERRORS.keys())
def test_validation_errors(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize(
    "num_units, num_silos, expected",
    [(10, 3, [4, 3, 3]), (12, 4, [3] * 4), (5, 5, [1] * 5)],
    ids=["uneven", "even", "singletons"],
)
def test_split_iid_sizes(num_units, num_silos, expected):
    ids = split_iid(num_units, num_silos, seed=3)
    assert len(ids) == num_units and np.issubdtype(ids.dtype, np.integer)
    assert np.bincount(ids, minlength=num_silos).tolist() == expected
    np.testing.assert_array_equal(ids, split_iid(num_units, num_silos, seed=3))


def test_split_iid_explicit_sizes_and_seed():
    ids = split_iid(537, 2, sizes=[300, 237], seed=0)
    assert np.bincount(ids).tolist() == [300, 237]
    assert not np.array_equal(ids, split_iid(537, 2, sizes=[300, 237], seed=1))
    data = FederatedData.from_groups(ids, y=np.arange(537.0))
    assert data.sizes == (300, 237)
    np.testing.assert_array_equal(data.pooled()["y"], np.arange(537.0))


@pytest.mark.parametrize(
    "num_classes, num_silos",
    [(10, 10), (5, 5), (10, 20)],
    ids=["10-classes", "5-classes", "two-silos-per-class"],
)
def test_split_label_skew_dominant_share(num_classes, num_silos):
    labels = np.repeat(np.arange(num_classes), 1000 // num_classes)
    ids = split_label_skew(labels, num_silos, 0.9, seed=2)
    assert len(ids) == 1000 and ids.min() >= 0
    counts = np.bincount(ids, minlength=num_silos)
    assert counts.tolist() == [1000 // num_silos] * num_silos
    for j in range(num_silos):
        share = np.mean(labels[ids == j] == j % num_classes)
        assert abs(share - 0.9) <= 0.02, (j, share)
        # the other labels are spread roughly uniformly
        others = np.bincount(labels[ids == j], minlength=num_classes)
        others = np.delete(others, j % num_classes)
        assert others.max() - others.min() <= 2, others
    np.testing.assert_array_equal(ids, split_label_skew(labels, num_silos, 0.9, seed=2))


def test_split_label_skew_leftovers_and_exhausted_labels():
    labels = np.array(["a"] * 5 + ["b"] * 40 + ["c"] * 58)  # 103 units, "a" runs out
    ids = split_label_skew(labels, 3, 0.9, seed=0)
    assert ids.min() >= 0 and len(ids) == 103
    assert sorted(np.bincount(ids).tolist()) == [34, 34, 35]
    assert np.mean(labels[ids == 2] == "c") >= 0.88
    assert np.all(ids[labels == "a"] == 0)  # the scarce label goes to its silo first


def test_split_dirichlet_reproducible_and_non_empty():
    labels = np.repeat(np.arange(5), 40)
    split = lambda seed, alpha=0.3: split_dirichlet(
        labels, 8, alpha, seed=seed, min_size=5
    )
    a = split(4)
    np.testing.assert_array_equal(a, split(4))
    assert not np.array_equal(a, split(5))
    assert len(a) == 200 and np.bincount(a, minlength=8).min() >= 5

    def top_share(ids):  # mean share of each silo's most frequent label
        return np.mean(
            [np.bincount(labels[ids == j]).max() / np.sum(ids == j) for j in range(8)]
        )

    # small alpha: silos dominated by few labels; large alpha: close to iid (0.2)
    assert top_share(a) > 0.45 and top_share(split(4, alpha=1e3)) < 0.35


def test_min_silo_size_refuses_small_silos_by_name():
    y = np.arange(6.0)
    with pytest.raises(ValueError, match=r"silo 1 \(label 'b'\) holds 1 unit\(s\)"):
        FederatedData.from_groups(list("aabccc"), min_silo_size=2, y=y)
    with pytest.raises(ValueError, match=r"silo 0 holds 1; silo 2 holds 2 unit"):
        FederatedData.from_silos(
            [{"y": y[:1]}, {"y": y[1:4]}, {"y": y[4:]}], min_silo_size=3
        )
    with pytest.raises(ValueError, match="min_silo_size must be None or an int"):
        FederatedData.from_groups([0, 1], min_silo_size=1.5, y=y[:2])
    # at the minimum, or with no minimum (the default), every silo is kept
    data = FederatedData.from_groups(list("aabbcc"), min_silo_size=2, y=y)
    assert data.sizes == (2, 2, 2)
    assert FederatedData.from_groups(list("aabccc"), y=y).sizes == (2, 1, 3)
