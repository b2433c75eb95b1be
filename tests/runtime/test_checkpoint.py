# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Checkpoint files: exact round trips (float64, typed keys), atomic writes that
never leave a half-written newest file, and a named error for every file that is
damaged or written for something else."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_fed.runtime import checkpoint as ckpt
from numpyro_fed.runtime.checkpoint import (
    CheckpointError,
    RunCheckpoints,
    checkpoint_steps,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)


def _tree(shift=0.0):
    return {
        "server": (jnp.arange(3.0) + shift, jnp.int64(2**40)),
        "silos": {"eta": jnp.full((2, 2), 0.1) + shift, "ok": jnp.array([True, False])},
        "key": jax.random.split(jax.random.key(3), 2),
    }


def _equal(a, b):
    def same(x, y):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            assert jax.random.key_impl(x) == jax.random.key_impl(y)
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        return x.dtype == y.dtype and bool(jnp.array_equal(x, y))

    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        jax.tree.leaves(jax.tree.map(same, a, b))
    )


def test_round_trip_is_exact_and_keeps_the_newest_two(tmp_path, enable_x64):
    for step in (3, 6, 9):
        path = save_checkpoint(tmp_path, _tree(step), step=step, meta={"a": [1, 2]})
        assert path == latest_checkpoint(tmp_path)
    assert checkpoint_steps(tmp_path) == [6, 9]
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoint-000000006.npz",
        "checkpoint-000000009.npz",
    ]
    template = jax.eval_shape(_tree)  # ShapeDtypeStructs are templates too
    tree, step, meta = load_checkpoint(tmp_path, template, expect_meta={"a": (1, 2)})
    assert step == 9 and meta == {"a": [1, 2]}
    assert _equal(tree, _tree(9))
    assert tree["server"][1].dtype == jnp.int64 and int(tree["server"][1]) == 2**40


def test_a_template_may_depend_on_the_step(tmp_path):
    save_checkpoint(tmp_path, {"h": jnp.zeros((5, 2), jnp.float32)}, step=5)
    tree, _, _ = load_checkpoint(
        tmp_path, lambda step, meta: {"h": jax.ShapeDtypeStruct((step, 2), "float32")}
    )
    assert tree["h"].shape == (5, 2)


def test_a_crash_while_writing_leaves_the_previous_checkpoint_newest(
    tmp_path, monkeypatch
):
    save_checkpoint(tmp_path, _tree(1.0), step=1)

    def dies_half_way(f, **arrays):
        f.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt  # killed mid-write

    monkeypatch.setattr(ckpt.np, "savez", dies_half_way)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(tmp_path, _tree(2.0), step=2)
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["checkpoint-000000001.npz"]  # no temp file left
    tree, step, _ = load_checkpoint(tmp_path, _tree())
    assert step == 1 and _equal(tree, _tree(1.0))


def _damage(path, how):
    if how == "truncated":
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif how == "not an npz":
        path.write_bytes(b"hello, not a zip file at all")
    elif how == "flipped byte":
        data = bytearray(path.read_bytes())
        data[60] ^= 0xFF  # inside the first entry: its CRC no longer matches
        path.write_bytes(bytes(data))
    elif how == "bad json":
        with np.load(path) as npz:
            arrays = {k: npz[k] for k in npz.files}
        arrays["checkpoint_meta"] = np.frombuffer(b"{not json", np.uint8)
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    elif how == "no metadata":
        np.savez(path, leaf_0=np.zeros(3))
    elif how == "other version":
        with np.load(path) as npz:
            arrays = {k: npz[k] for k in npz.files}
        header = json.loads(arrays["checkpoint_meta"].tobytes())
        arrays["checkpoint_meta"] = np.frombuffer(
            json.dumps({**header, "format": 99}).encode(), np.uint8
        )
        with open(path, "wb") as f:
            np.savez(f, **arrays)


DAMAGE = {
    "truncated": "not a readable checkpoint",
    "not an npz": "not a readable checkpoint",
    "flipped byte": "not a readable checkpoint",
    "bad json": "unreadable metadata",
    "no metadata": "has no metadata",
    "other version": "format version 99",
}


@pytest.mark.parametrize("how", sorted(DAMAGE))
def test_a_damaged_file_is_refused_by_name(tmp_path, how):
    path = save_checkpoint(tmp_path, _tree(), step=4)
    _damage(path, how)
    with pytest.raises(CheckpointError, match=DAMAGE[how]) as error:
        load_checkpoint(tmp_path, _tree())
    assert str(path) in str(error.value)


def test_missing_and_empty_directories_are_named(tmp_path):
    with pytest.raises(CheckpointError, match="No checkpoint directory .*nowhere"):
        load_checkpoint(tmp_path / "nowhere", _tree())
    with pytest.raises(CheckpointError, match="No checkpoint in"):
        load_checkpoint(tmp_path, _tree())
    assert latest_checkpoint(tmp_path / "nowhere") is None


def test_a_checkpoint_of_another_tree_or_run_is_refused(tmp_path):
    save_checkpoint(tmp_path, _tree(), step=4, meta={"algorithm": "SFVI", "J": 2})
    other = _tree()
    other["silos"]["eta"] = jnp.zeros((3, 2))
    with pytest.raises(
        CheckpointError, match=r"\['silos'\]\['eta'\] is float.*\[2, 2\]"
    ):
        load_checkpoint(tmp_path, other)
    with pytest.raises(CheckpointError, match=r"lacks field \['extra'\]"):
        load_checkpoint(tmp_path, {**_tree(), "extra": jnp.zeros(1)})
    rbg = {**_tree(), "key": jax.random.split(jax.random.key(0, impl="rbg"), 2)}
    with pytest.raises(CheckpointError, match=r"\['key'\]"):
        load_checkpoint(tmp_path, rbg)
    # the same key data, another implementation: caught by the fingerprint
    save_checkpoint(tmp_path / "rbg", rbg, step=1)
    unsafe = {
        **_tree(),
        "key": jax.random.split(jax.random.key(0, impl="unsafe_rbg"), 2),
    }
    with pytest.raises(CheckpointError, match=r"holds \['key'\]:key<rbg>"):
        load_checkpoint(tmp_path / "rbg", unsafe)
    with pytest.raises(CheckpointError, match="algorithm='SFVI'; this run has "):
        load_checkpoint(tmp_path, _tree(), expect_meta={"algorithm": "PVI"})
    with pytest.raises(CheckpointError, match="no 'runtime'"):
        load_checkpoint(tmp_path, _tree(), expect_meta={"runtime": "events"})
    with pytest.raises(CheckpointError, match="later than step 2"):
        save_checkpoint(tmp_path, _tree(), step=2)
    with pytest.raises(ValueError, match="JSON"):
        save_checkpoint(tmp_path, _tree(), step=5, meta={"f": object()})


def test_run_checkpoints_stop_at_multiples_and_refuse_a_used_directory(tmp_path):
    saver = RunCheckpoints(tmp_path, {"algorithm": "X"}, every=3)
    assert [saver.next_stop(s, 7) for s in range(7)] == [3, 3, 3, 6, 6, 6, 7]
    assert RunCheckpoints(tmp_path, {}).next_stop(2, 7) == 7
    saver.check_empty()
    saver.save({"x": jnp.ones(2)}, {"loss": jnp.arange(3.0)}, 3)
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        saver.check_empty()
    record = {"loss": jax.ShapeDtypeStruct((), jnp.arange(3.0).dtype)}
    resumed = RunCheckpoints(tmp_path, {"algorithm": "X"}, every=3)
    state, past, done = resumed.load({"x": jnp.zeros(2)}, record, 7)
    assert done == 3 and past["loss"].tolist() == [0.0, 1.0, 2.0]
    resumed.save(state, {"loss": jnp.array([3.0])}, 4)
    _, past, done = RunCheckpoints(tmp_path, {}).load({"x": jnp.zeros(2)}, record, 7)
    assert done == 4 and past["loss"].tolist() == [0.0, 1.0, 2.0, 3.0]
    with pytest.raises(CheckpointError, match="beyond num_steps=3"):
        RunCheckpoints(tmp_path, {}).load({"x": jnp.zeros(2)}, record, 3)
    with pytest.raises(ValueError, match="checkpoint_every"):
        RunCheckpoints(tmp_path, {}, every=0)
