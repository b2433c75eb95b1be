# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Resuming on a fresh object (issue 19): k rounds on one object, then k more from
its state on a new object (in this process, or in a new one from the checkpoint
files), end bit for bit where 2k uninterrupted rounds end, for every VI class."""

import os
from pathlib import Path
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.runtime.checkpoint import load_checkpoint, save_checkpoint
from tests import _models as m

FED = nf.federate(m.normal_normal, silos="group")
MAKE = {
    "SFVI": lambda: nf.SFVI(FED, nf.AutoMeanField(FED), optax.adam(0.05)),
    "SFVIAvg": lambda: nf.SFVIAvg(
        FED, nf.AutoMeanField(FED), optax.adam(0.05), local_steps=2
    ),
    # average=0: the returned params are the last q. By default they average the
    # last half of the rounds *this run* made, which a run resumed from a state
    # (not from its checkpoints, whose history it reads) does not hold; the state,
    # what resuming is about, is the same either way.
    "PVI": lambda: nf.PVI(FED, local_optim=optax.adam(0.05), local_steps=2, average=0),
    "FedGVI": lambda: nf.FedGVI(
        FED, local_optim=optax.adam(0.05), local_steps=2, loss=("gce", 0.5), average=0
    ),
}


def _data():
    """Three silos of 2, 2 and 3 groups (padded): local latents in every state."""
    y = np.random.default_rng(0).normal(size=(7, 3)) + 1.0
    return nf.FederatedData.from_groups(np.array([0, 0, 1, 1, 2, 2, 2]), y=y)


def _vertical():
    from tests.vertical import _fixtures as fx

    def make():
        return nf.VerticalSFVI(
            nf.augment(fx.gaussian_model(), 0.5), nf.VerticalFamily(), optax.adam(0.05)
        )

    return make, fx.gaussian_data()


def _case(name):
    if name == "VerticalSFVI":
        return _vertical()
    return MAKE[name], _data()


def assert_same_tree(a, b):
    """Every leaf equal, bit for bit (keys by their data)."""

    def data(x):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            return jax.random.key_data(x)
        return x

    leaves_a, tree_a = jax.tree.flatten(a)
    leaves_b, tree_b = jax.tree.flatten(b)
    assert tree_a == tree_b
    for x, y in zip(leaves_a, leaves_b, strict=True):
        x, y = data(x), data(y)
        assert x.dtype == y.dtype and x.shape == y.shape
        assert jnp.array_equal(x, y)


def assert_resumed(resumed, whole, k):
    """The resumed run's state and params equal the whole run's, bit for bit, and
    its k losses are the whole run's last k."""
    assert_same_tree((resumed.state, resumed.params), (whole.state, whole.params))
    assert jnp.array_equal(resumed.losses, whole.losses[k:])


# (class, progress bar): a run scans without one (VerticalSFVI loops either way at
# this length); SFVI's loop covers the jitted round of the other mode.
CASES = [(name, False) for name in [*MAKE, "VerticalSFVI"]] + [("SFVI", True)]


@pytest.mark.parametrize(
    "name, progress_bar",
    CASES,
    ids=[f"{n}-{'loop' if b else 'scan'}" for n, b in CASES],
)
def test_a_fresh_object_resumes_a_state_bit_for_bit(name, progress_bar):
    make, data = _case(name)
    k, key, kw = 2, jax.random.key(0), {"progress_bar": progress_bar}
    first = make()
    whole = first.run(key, 2 * k, data, **kw)
    half = first.run(key, k, data, **kw)
    fresh = make()
    resumed = fresh.run(jax.random.key(7), k, data, init_state=half.state, **kw)
    assert_resumed(resumed, whole, k)
    # nothing built inside a trace leaked into the fresh object: it goes on working
    assert jnp.isfinite(fresh.evaluate(resumed.state, data))
    if name != "VerticalSFVI":
        draws = fresh.sample_posterior(key, resumed.params, data, num_samples=2)
        assert all(jnp.isfinite(v).all() for v in draws.values())
    # update (not run) on another fresh object takes the state too
    assert_same_tree(make().update(half.state, data), first.update(half.state, data))


RESUME = """
import sys
import jax
import optax

jax.config.update("jax_enable_x64", True)
import numpyro_fed as nf
from numpyro_fed.runtime.checkpoint import load_checkpoint, save_checkpoint
from tests.infer.test_resume_fresh import MAKE, _data

name, states, out, runs = sys.argv[1:]
data = _data()
# the template from another object: the one that resumes has built nothing yet
template = {"state": MAKE[name]().init(jax.random.key(123), data)}
state = load_checkpoint(states, template)[0]["state"]
algo = MAKE[name]()
result = algo.run(jax.random.key(5), 2, data, init_state=state, progress_bar=False)
save_checkpoint(out, {"state": result.state, "losses": result.losses}, step=4)
# the other way back: the run's own checkpoints, resumed by a new object
again = MAKE[name]().run(
    jax.random.key(5), 4, data, progress_bar=False, checkpoint_dir=runs, resume=True
)
save_checkpoint(out, {"state": again.state, "losses": again.losses}, step=5)
"""


@pytest.mark.parametrize("name", ["PVI"])
def test_a_new_process_resumes_from_the_checkpoint_files_bit_for_bit(name, tmp_path):
    """Two rounds here, saved; two more in a new Python process on a new object,
    from the saved state (init_state) and from the run's checkpoints (resume)."""
    algo, data, key = MAKE[name](), _data(), jax.random.key(0)
    whole = algo.run(key, 4, data, progress_bar=False)
    half = algo.run(key, 2, data, progress_bar=False, checkpoint_dir=tmp_path / "runs")
    save_checkpoint(tmp_path / "states", {"state": half.state}, step=2)
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": str(root), "JAX_PLATFORMS": "cpu"}
    # The new process compiles the programs this one just compiled: it reads them from
    # the suite's on-disk cache when there is one (a load, not a compilation; the
    # results are the same programs, so bit-for-bit equality is unaffected).
    if jax.config.jax_compilation_cache_dir:
        env["JAX_COMPILATION_CACHE_DIR"] = jax.config.jax_compilation_cache_dir
        env["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
        env["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"
    args = [name, tmp_path / "states", tmp_path / "out", tmp_path / "runs"]
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(RESUME), *map(str, args)],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    template = {"state": whole.state, "losses": whole.losses[2:]}
    back = load_checkpoint(tmp_path / "out", template, step=4)[0]
    assert_same_tree(back, {"state": whole.state, "losses": whole.losses[2:]})
    template = {"state": whole.state, "losses": whole.losses}
    back = load_checkpoint(tmp_path / "out", template, step=5)[0]
    assert_same_tree(back, {"state": whole.state, "losses": whole.losses})
