# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Driver.run with checkpoints: a run killed after round m and resumed ends bit for
bit where an uninterrupted run ends (state, keys, history), on every in-process
runtime and in both run modes; chunking the scan changes nothing; a checkpoint of
another run is refused by name."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.runtime.checkpoint import CheckpointError, checkpoint_steps
from tests import _models as m


def _data(num_silos=2):
    arrays = m.logistic_data(num_rows=12)
    return nf.FederatedData.from_groups(np.arange(12) % num_silos, **arrays)


FED = nf.federate(m.logistic, silos="data")
MAKE = {
    "SFVI": lambda **kw: nf.SFVI(FED, nf.AutoMeanField(FED), optax.adam(0.05), **kw),
    "SFVIAvg": lambda **kw: nf.SFVIAvg(
        FED, nf.AutoMeanField(FED), optax.adam(0.05), local_steps=2, **kw
    ),
    "PVI": lambda **kw: nf.PVI(FED, local_optim=optax.adam(0.05), **kw),
}


def assert_same_run(a, b):
    """Every leaf of the state (the key's data included) and of the history equal,
    bit for bit."""

    def data(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(x)
        return x

    leaves_a, tree_a = jax.tree.flatten((a.state, a.history, a.losses, a.params))
    leaves_b, tree_b = jax.tree.flatten((b.state, b.history, b.losses, b.params))
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        x, y = data(x), data(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert jnp.array_equal(x, y)


CASES = {  # name: (class, runtime options, progress_bar)
    "sfvi-simulate-loop": ("SFVI", {}, True),
    "sfvi-simulate-scan": ("SFVI", {}, False),
    "sfvi-sequential": ("SFVI", {"runtime": "sequential", "participation": 0.5}, True),
    "sfvi-events-loop": ("SFVI", {"runtime": "events", "order": "random"}, True),
    "sfvi-events-scan": ("SFVI", {"runtime": "events", "max_staleness": 1}, False),
    "sfvi-sharded-loop": ("SFVI", {"runtime": "sharded", "participation": 0.5}, True),
    "pvi-simulate-loop": ("PVI", {}, True),
    "pvi-sequential-scan": ("PVI", {"schedule": "sequential"}, False),
}
SLOW = {"pvi-sequential-scan"}
# (rounds, killed after, checkpoint every): the loop stops at a round that is not a
# checkpoint; the scan compiles each chunk length, so it uses two lengths only.
ROUNDS = {True: (7, 4, 3), False: (8, 4, 4)}


@pytest.mark.parametrize(
    "case",
    [
        pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c
        for c in sorted(CASES)
    ],
)
def test_a_killed_and_resumed_run_equals_an_uninterrupted_one(case, tmp_path):
    """Killed by stopping after round m (and, on the simulate runtime, by an
    exception inside the run), then resumed: the same state, keys and history."""
    name, options, progress_bar = CASES[case]
    num_steps, killed_at, every = ROUNDS[progress_bar]
    algo, data, key = MAKE[name](**options), _data(), jax.random.key(0)
    kw = {"progress_bar": progress_bar, "checkpoint_every": every}
    whole = algo.run(key, num_steps, data, progress_bar=progress_bar)
    killed = algo.run(key, killed_at, data, checkpoint_dir=tmp_path, **kw)
    # every k rounds, and at the end
    assert checkpoint_steps(tmp_path) == sorted({every, killed_at})
    resumed = algo.run(
        jax.random.key(99),  # ignored: the key is in the checkpoint
        num_steps,
        data,
        checkpoint_dir=tmp_path,
        resume=True,
        **kw,
    )
    last = num_steps - (num_steps % every or every)
    assert checkpoint_steps(tmp_path) == [last, num_steps]
    assert_same_run(resumed, whole)
    assert len(resumed.losses) == num_steps
    assert jnp.array_equal(killed.losses, whole.losses[:killed_at])
    if name == "PVI":  # the q history survives the checkpoint
        assert jax.tree.leaves(resumed.history["q"])[0].shape[0] == num_steps
    # a finished run resumes to itself
    again = algo.run(key, num_steps, data, checkpoint_dir=tmp_path, resume=True, **kw)
    assert_same_run(again, whole)
    if "simulate" in case:
        raised = kill_by_raising(algo, key, num_steps, data, tmp_path / "b", kw)
        assert raised == every  # the round or chunk after the first checkpoint
        resumed = algo.run(
            key, num_steps, data, checkpoint_dir=tmp_path / "b", resume=True, **kw
        )
        assert_same_run(resumed, whole)


def kill_by_raising(algo, key, num_steps, data, directory, kw):
    """Run until an exception inside the run (in the round, or the scan chunk,
    after the first checkpoint); return the last checkpoint's step."""
    calls = []

    def dies(state, info):
        calls.append(1)
        if len(calls) == (kw["checkpoint_every"] + 1 if kw["progress_bar"] else 2):
            raise KeyboardInterrupt

    algo._check_info = dies  # an instance attribute shadows the method
    try:
        with pytest.raises(KeyboardInterrupt):
            algo.run(key, num_steps, data, checkpoint_dir=directory, **kw)
    finally:
        del algo._check_info
    return checkpoint_steps(directory)[-1]


@pytest.mark.slow
def test_chunking_the_scan_changes_nothing(tmp_path):
    """(The scan cases above check it too: their resumed chunks are not the
    uninterrupted run's.)"""
    algo, data, key = MAKE["SFVIAvg"](), _data(3), jax.random.key(2)
    whole = algo.run(key, 7, data, progress_bar=False)
    for every, sub in ((1, "one"), (2, "two"), (7, "all")):
        chunked = algo.run(
            key,
            7,
            data,
            progress_bar=False,
            checkpoint_every=every,
            checkpoint_dir=tmp_path / sub,
        )
        assert_same_run(chunked, whole)


def test_a_checkpoint_of_another_run_is_refused(tmp_path):
    data, key = _data(), jax.random.key(0)
    MAKE["SFVI"]().run(key, 2, data, checkpoint_dir=tmp_path)

    def resume(algo, data=data):
        return algo.run(key, 4, data, checkpoint_dir=tmp_path, resume=True)

    with pytest.raises(CheckpointError, match="algorithm='SFVI'; this run has .*Avg"):
        resume(MAKE["SFVIAvg"]())
    with pytest.raises(CheckpointError, match="runtime='simulate'; .*'events'"):
        resume(MAKE["SFVI"](runtime="events"))
    with pytest.raises(CheckpointError, match="data_layout="):
        resume(MAKE["SFVI"](), _data(3))
    other_guide = nf.SFVI(FED, nf.AutoGlobalLocalNormal(FED), optax.adam(0.05))
    with pytest.raises(CheckpointError, match=r"field \['state'\]"):
        resume(other_guide)
    with pytest.raises(CheckpointError, match="already holds a checkpoint"):
        MAKE["SFVI"]().run(key, 4, data, checkpoint_dir=tmp_path)
    with pytest.raises(CheckpointError, match="beyond num_steps=1"):
        MAKE["SFVI"]().run(key, 1, data, checkpoint_dir=tmp_path, resume=True)
    with pytest.raises(CheckpointError, match="No checkpoint directory .*x"):
        MAKE["SFVI"]().run(key, 4, data, checkpoint_dir=tmp_path / "x", resume=True)
    with pytest.raises(ValueError, match="need a checkpoint_dir"):
        MAKE["SFVI"]().run(key, 4, data, resume=True)


@pytest.mark.slow
@pytest.mark.parametrize("runtime", ["simulate", "sequential"])
def test_vertical_sfvi_resumes_bit_for_bit(runtime, tmp_path):
    from tests.vertical import _fixtures as fx

    data = fx.gaussian_data()
    vfl = nf.VerticalSFVI(
        nf.augment(fx.gaussian_model(), 0.5),
        nf.VerticalFamily(),
        optax.adam(0.05),
        runtime=runtime,
    )
    key, kw = jax.random.key(0), {"progress_bar": False, "checkpoint_every": 3}
    whole = vfl.run(key, 6, data, progress_bar=False)
    vfl.run(key, 4, data, checkpoint_dir=tmp_path, **kw)
    resumed = vfl.run(key, 6, data, checkpoint_dir=tmp_path, resume=True, **kw)
    assert_same_run(resumed, whole)
