# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""``nf.audit``: every leaf that crosses the wire, with shape and bytes, and a flag on
what could carry a silo's units (every algorithm's audit is in test_contract.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.densities import data_template
from numpyro_fed.elbo import draw_global, noise_keys
from numpyro_fed.protocol import FederatedAlgorithm, Message, silo_data_of
from numpyro_fed.util import constrain, take
from tests import _models as m


def mean_model(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with nf.silo_plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def leaky(padded: int) -> FederatedAlgorithm:
    """A made-up algorithm that leaks: its message has a slot per padded unit and
    its reply sends the silo's rows next to their (harmless) sum."""

    def init_server(key):
        return {"w": jnp.zeros(2)}

    def server_message(state, key):
        return Message({"w": state["w"], "per_unit": jnp.zeros(padded)})

    def silo_step(message, state, data, key):
        y = data.arrays["y"]
        return {"sum": jnp.sum(jnp.where(data.mask, y, 0.0)), "rows": y}, state

    def server_step(state, replies, key, participating):
        return state, ()

    return FederatedAlgorithm(
        init_server, lambda key, data: (), server_message, silo_step, server_step
    )


def test_flags_a_reply_that_grows_with_units_and_a_unit_sized_message():
    data = nf.FederatedData.from_groups([0, 0, 0, 1, 1, 2, 2], y=np.arange(7.0))
    report = nf.audit(leaky(data.padded_size), data)
    flags = {(leaf.part, leaf.path): leaf.flag for leaf in report.leaves}
    assert set(flags) == {
        ("broadcast", "['w']"),
        ("broadcast", "['per_unit']"),
        ("reply", "['sum']"),
        ("reply", "['rows']"),
    }
    assert flags[("broadcast", "['w']")] == flags[("reply", "['sum']")] == ""
    assert flags[("broadcast", "['per_unit']")].startswith("axis of the padded size 3")
    assert flags[("reply", "['rows']")] == (
        "grows with the silo's units ((3,) at P=3, (6,) at P=6)"
    )
    assert {(leaf.part, leaf.path) for leaf in report.flagged} == {
        ("broadcast", "['per_unit']"),
        ("reply", "['rows']"),
    }
    table = str(report)
    assert table.splitlines()[0].split() == [
        "direction", "part", "path", "shape", "dtype", "bytes", "flag",
    ]  # fmt: skip
    assert "2 leaf(s) flagged" in table


def test_lists_small_silos_and_reads_bytes_off_the_shapes(enable_x64):
    data = nf.FederatedData.from_groups([0, 1, 1, 1, 2, 2], y=np.arange(6.0))
    report = nf.audit(nf.DSGLD(mean_model, 1e-3, tau=4).algorithm(data), data)
    assert report.small_silos == (0,) and report.sizes == (1, 3, 2)
    assert "silo 0 holds 1 unit(s) (< min_units=2)" in str(report)
    assert nf.audit(
        nf.DSGLD(mean_model, 1e-3, tau=4).algorithm(data), data, min_units=3
    ).small_silos == (0, 2)
    rows = {(leaf.direction, leaf.path): leaf for leaf in report.leaves}
    # down: the position (float64), the step counter and the routed silo index
    assert report.bytes("server -> silo") == 8 + 4 + 4
    assert rows[("silo -> server", ".trajectory['mu']")].shape == (4,)
    assert report.bytes("silo -> server") == 4 * 8


def test_the_reproducible_chain_key_shows_on_the_wire():
    """The FSGLD key that let the server replay a silo's noise is a leaf of the
    reproducible mode's message, and of no message by default."""
    data = nf.FederatedData.from_groups([0, 0, 1, 1], y=np.arange(4.0))
    paths = {}
    for reproducible in (False, True):
        kernel = nf.DSGLD(mean_model, 1e-3, tau=2, reproducible=reproducible)
        report = nf.audit(kernel.algorithm(data), data)
        paths[reproducible] = {leaf.path: leaf for leaf in report.leaves}
    assert ".rng_key" not in paths[False]
    key = paths[True][".rng_key"]
    assert key.direction == "server -> silo" and key.nbytes == 8


def test_a_user_class_is_audited_with_its_own_keys():
    """``SFVI`` gives its algorithm and key shapes (one key per particle); silos
    padded to 3 units, the size of the global parameters, flag the message (a
    coincidence that padding to 5 tells apart)."""
    arrays = m.hierarchical_data(num_groups=7, num_obs=4)
    data = nf.FederatedData.from_groups(m.split_groups(7, 3), **arrays)
    fed = nf.federate(m.hierarchical, silos="group")
    fit = nf.SFVI(fed, nf.AutoGlobalLocalNormal(fed), optax.adam(0.05), num_particles=2)
    coincidence = nf.audit(fit, data).flagged
    assert {leaf.path for leaf in coincidence} >= {".eta_global['loc']"}
    assert {leaf.direction for leaf in coincidence} == {"server -> silo"}
    data = nf.FederatedData.from_groups(m.split_groups(7, 3), pad_to=5, **arrays)
    fed = nf.federate(m.hierarchical, silos="group")
    fit = nf.SFVI(fed, nf.AutoGlobalLocalNormal(fed), optax.adam(0.05), num_particles=2)
    report = nf.audit(fit, data)
    assert report.flagged == ()
    keys = next(leaf for leaf in report.leaves if leaf.path == ".global_keys")
    assert keys.shape[0] == 2  # one key per particle


def test_bad_arguments_are_named():
    data = nf.FederatedData.from_groups([0, 1], y=np.arange(2.0))
    algorithm = leaky(data.padded_size)
    with pytest.raises(ValueError, match="min_units must be a positive int"):
        nf.audit(algorithm, data, min_units=0)
    with pytest.raises(TypeError, match="needs a FederatedAlgorithm or a class"):
        nf.audit(object(), data)
    with pytest.raises(TypeError, match="needs the silos' FederatedData, got dict"):
        nf.audit(algorithm, {"y": np.arange(2.0)})
    assert jax.tree.leaves(nf.audit(algorithm, data).leaves)  # the good call runs


def test_a_one_unit_silo_gives_its_row_away_in_sfvi(enable_x64):
    """Why the audit lists small silos: without local latents, SFVI's reply is the
    gradient of the silo's log-likelihood at a z_G the server drew itself, so a
    one-unit silo with a Gaussian likelihood sends its row (y = z_G + gradient),
    whatever the silo's own noise."""
    y = np.array([0.3, 1.2, 2.5, -0.7, 0.8338])
    data = nf.FederatedData.from_groups([0, 0, 1, 1, 2], y=y)
    guide = nf.AutoGlobalLocalNormal(mean_model)
    guide.setup(data)
    algorithm = nf.sfvi(
        mean_model, guide, optax.adam(0.05), data_template(data.silo(0))
    )
    keys = noise_keys(jax.random.key(0), 1)  # one per particle
    report = nf.audit(algorithm, data, server_key=keys, silo_key=keys)
    assert report.small_silos == (2,) and report.flagged == ()
    server = algorithm.init_server(jax.random.key(1))
    message = algorithm.server_message(server, noise_keys(jax.random.key(2), 1))
    silo = take(silo_data_of(data), 2)
    state = algorithm.init_silo(jax.random.key(3), silo)
    reply, _ = algorithm.silo_step(
        message.at(2), state, silo, noise_keys(jax.random.key(4), 1)
    )
    eta = constrain(guide.param_constraints()[0], message.broadcast.eta_global)
    eps = guide.global_noise(message.broadcast.global_keys[0])
    z_global = draw_global(guide, eta, eps).z
    y_hat = z_global + reply.grad_eta_global["loc"]  # d/d loc = d/d z_G
    np.testing.assert_allclose(y_hat, [0.8338], rtol=1e-12)
