# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Every run counts the bytes it put on the wire (``history["bytes_down"]`` and
``["bytes_up"]``), and the count equals the sizes of the real messages."""

import jax
import numpy as np
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.protocol import Message, silo_data_of
from numpyro_fed.util import take
from tests.infer.test_driver import ALGORITHMS, _logistic
from tests.vertical import _fixtures as fx


def _real_bytes(tree):
    """Bytes of the concrete arrays of ``tree`` (a typed key as its key data)."""
    leaves = jax.tree.leaves(tree)
    keys = lambda x: jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)  # noqa: E731
    return sum(
        int(jax.random.key_data(x).nbytes if keys(x) else x.nbytes) for x in leaves
    )


def _sizes(obj, state, data):
    """(down, up) bytes of silo 0's real messages in a round from ``state``."""
    federation = obj.federation(data)
    algorithm = federation.algorithm
    _, server_key = federation.round_keys(state.rng_key)
    message = algorithm.server_message(state.server, server_key)
    routed = jax.tree.map(lambda x: x[0], message.routed)
    reply, _ = algorithm.silo_step(
        Message(message.broadcast, routed),
        take(state.silos, 0),
        take(silo_data_of(data), 0),
        jax.random.split(jax.random.key(1), federation.silo_key_like.shape),
    )
    return _real_bytes((message.broadcast, routed)), _real_bytes(reply)


@pytest.mark.parametrize(
    "options",
    [{"participation": 0.5}, {"runtime": "events"}],
    ids=["half-participation", "events"],
)
@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_run_counts_the_bytes_of_its_messages(name, options):
    fed, data = _logistic(4)
    obj = ALGORITHMS[name](fed, **options)
    state = obj.init(jax.random.key(0), data)
    result = obj.run(jax.random.key(0), 4, data, progress_bar=False)
    down, up = _sizes(obj, state, data)
    counts = np.asarray(result.history["contacted"]).sum(-1)
    if options.get("participation"):
        assert (counts == 2).all()  # a count that is not all silos
    else:
        assert (counts == 4).all()  # an events pass visits each silo once
    np.testing.assert_array_equal(result.history["bytes_down"], counts * down)
    np.testing.assert_array_equal(result.history["bytes_up"], counts * up)
    assert down > 0 and up > 0
    # the same count with a progress bar (one jitted round at a time)
    looped = obj.run(jax.random.key(0), 4, data, progress_bar=True, init_state=state)
    np.testing.assert_array_equal(
        looped.history["bytes_up"], result.history["bytes_up"]
    )


def test_vertical_run_counts_every_phase():
    """Vertical SFVI's round is several contract rounds (its phases), each sending
    the whole message to every party."""
    data = fx.gaussian_data(12)
    aug = nf.augment(fx.gaussian_model(), fx.RHO)
    vfl = nf.VerticalSFVI(aug, nf.VerticalFamily(aux="meanfield"), optax.adam(0.05))
    result = vfl.run(jax.random.key(0), 3, data, progress_bar=False)
    federation = vfl.federation(data)
    _, server_key = federation.round_keys(result.state.rng_key)
    message = federation.algorithm.server_message(result.state.server, server_key)
    parties = len(fx.PARTIES)
    down = _real_bytes(message.broadcast) * parties + _real_bytes(message.routed)
    assert vfl.exchanges > 1
    np.testing.assert_array_equal(
        result.history["bytes_down"], np.full(3, vfl.exchanges * down)
    )
    up = np.asarray(result.history["bytes_up"])
    assert (up == up[0]).all() and up[0] > 0
