# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The remote round (flat dicts between a server and silos that each hold only their
own data, state and key) equals the simulated round with the same keys, for every
algorithm; a malformed reply is refused by name and a silo that does not answer is a
silo that did not take part."""

from functools import partial
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from numpyro_fed.protocol import silo_data_of
from numpyro_fed.runtime import simulate_round
from numpyro_fed.runtime.codec import TemplateMismatch
from numpyro_fed.runtime.remote import (
    Federation,
    RemoteServer,
    RemoteSilo,
    run_remote,
    silo_key,
)
from numpyro_fed.util import take
from tests import _models as m
from tests.algorithms.test_contract import CASES

NUM_ROUNDS = 3


def federation_of(case) -> Federation:
    """A case's algorithm with a key chain whose server keys look like the case's."""
    like = jax.eval_shape(lambda: case.server_key)

    def round_keys(rng_key):
        rng_key, key = jax.random.split(rng_key)
        return rng_key, jax.random.split(key, like.shape) if like.shape else key

    silo_data = silo_data_of(case.data)
    spec = jax.eval_shape(lambda: take(silo_data, 0))
    silo_like = jax.eval_shape(lambda: case.silo_keys[0])
    return Federation(case.algorithm, case.data.num_silos, spec, round_keys, silo_like)


def simulated(fed: Federation, silo_data, roots, rng_key, num_rounds, available):
    """The same run through runtime/simulate.py, keys drawn as the silos draw them."""
    alg = fed.algorithm
    rng_key, init_key = jax.random.split(rng_key)
    server = alg.init_server(init_key)
    scalar = jax.ShapeDtypeStruct((), roots.dtype)
    silos = jax.vmap(alg.init_silo)(
        jax.vmap(lambda r: silo_key(r, -1, scalar))(roots), silo_data
    )
    round_fn = jax.jit(partial(simulate_round, alg))
    infos = []
    for t in range(num_rounds):
        rng_key, server_key = fed.round_keys(rng_key)
        keys = jax.vmap(lambda r, t=t: silo_key(r, t, fed.silo_key_like))(roots)
        server, silos, info = round_fn(
            server, silos, silo_data, server_key, keys, jnp.asarray(available(t))
        )
        infos.append(info)
    return server, infos


# Every algorithm goes through these halves in tests/runtime/test_flower.py; here
# the broadcast-only and the select-one-silo shapes, without a transport.
@pytest.mark.parametrize("name", ["sfvi", "dsgld"])
def test_remote_round_equals_simulated_round(name):
    case = CASES[name]()
    fed = federation_of(case)
    silo_data = silo_data_of(case.data)
    roots = jax.random.split(jax.random.key(11), fed.num_silos)
    # silo 1 is unreachable in round 1: it must count as not taking part
    available = lambda t: np.arange(fed.num_silos) != (1 if t == 1 else -1)  # noqa: E731
    remote, remote_infos = run_remote(
        fed,
        [take(silo_data, j) for j in range(fed.num_silos)],
        list(roots),
        jax.random.key(5),
        NUM_ROUNDS,
        available=available,
    )
    sim, sim_infos = simulated(
        fed, silo_data, roots, jax.random.key(5), NUM_ROUNDS, available
    )
    m.tree_allclose(remote, sim, rtol=1e-6, atol=1e-8)
    for a, b in zip(remote_infos, sim_infos, strict=True):
        m.tree_allclose(a.loss, b.loss, rtol=1e-6, atol=1e-8)


def test_a_malformed_reply_is_refused_by_silo_and_field():
    case = CASES["sfvi"]()
    fed = federation_of(case)
    server = RemoteServer(fed)
    silo_data = silo_data_of(case.data)
    silo = RemoteSilo(fed, take(silo_data, 0), jax.random.key(1))
    state, rng_key = server.init(jax.random.key(0))
    messages, round_ = server.messages(state, rng_key, np.ones(fed.num_silos, bool))
    reply, _ = silo.step(messages[0], None, 0)
    name = next(k for k in reply if "grad_theta" in k or "grad_eta" in k)
    bad = {**reply, name: np.zeros((7,), reply[name].dtype)}
    with pytest.raises(TemplateMismatch, match=rf"silo 2's reply: field {re.escape(name)} is"):
        server.apply(state, round_, {0: reply, 2: bad})
    missing = {k: v for k, v in reply.items() if k != name}
    with pytest.raises(TemplateMismatch, match="silo 0's reply lacks field"):
        server.apply(state, round_, {0: missing})


def test_a_silo_with_data_of_another_layout_is_refused():
    case = CASES["sfvi"]()
    fed = federation_of(case)
    data = take(silo_data_of(case.data), 0)
    short = jax.tree.map(lambda x: x[:2], data)
    with pytest.raises(ValueError, match="do not have the federation's layout"):
        RemoteSilo(fed, short, jax.random.key(1))


def test_a_user_class_gives_its_federation():
    """``SFVI.federation(data)`` carries the class's algorithm and key chain: a
    remote run equals the simulated one with the silos' own keys, and the server's
    view gives the global parameters."""
    import optax

    import numpyro_fed as nf
    from numpyro_fed.infer.driver import FederatedState

    arrays = m.hierarchical_data(num_groups=7, num_obs=4)
    data = nf.FederatedData.from_groups(m.split_groups(7, 3), **arrays)
    model = nf.federate(m.hierarchical, silos="group")
    fit = nf.SFVI(model, nf.AutoStructured(model), optax.adam(0.05), num_particles=2)
    fed = fit.federation(data)
    assert fed.num_silos == 3 and fed.silo_key_like.shape == (2,)
    silo_data = silo_data_of(data)
    roots = jax.random.split(jax.random.key(2), 3)
    everyone = lambda t: np.ones(3, bool)  # noqa: E731
    remote, _ = run_remote(
        fed, [take(silo_data, j) for j in range(3)], list(roots), jax.random.key(0), 4
    )
    sim, _ = simulated(fed, silo_data, roots, jax.random.key(0), 4, everyone)
    m.tree_allclose(remote, sim, rtol=1e-10, atol=1e-12)
    params = fit.get_params(FederatedState(remote, None, None))
    assert params.eta_local == {} and set(params.eta_global) >= {"loc", "scale"}
