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

import numpyro_fed as nf
from numpyro_fed.protocol import silo_data_of
from numpyro_fed.runtime import event_round, simulate_round
from numpyro_fed.runtime.codec import TemplateMismatch
from numpyro_fed.runtime.groups import group_round, stack_groups
from numpyro_fed.runtime.remote import (
    Federation,
    RemoteServer,
    RemoteSilo,
    run_remote,
    silo_key,
)
from numpyro_fed.util import take
from tests import _models as m
from tests.algorithms.test_contract import CASES, silo_list, vertical_problem

NUM_ROUNDS = 3


def federation_of(case) -> Federation:
    """A case's algorithm with a key chain whose server keys look like the case's."""
    like = jax.eval_shape(lambda: case.server_key)

    def round_keys(rng_key):
        rng_key, key = jax.random.split(rng_key)
        return rng_key, jax.random.split(key, like.shape) if like.shape else key

    per_silo = silo_list(case)
    spec = jax.eval_shape(lambda: per_silo if case.groups else per_silo[0])
    silo_like = jax.eval_shape(lambda: case.silo_keys[0])
    return Federation(
        case.algorithm,
        len(per_silo),
        tuple(spec) if case.groups else spec,
        round_keys,
        silo_like,
        case.exchanges,
    )


def pvi_asynchronous():
    """``(federation, data)`` of ``PVI(schedule="asynchronous")`` visiting its 3
    silos in random order, each reading q up to 2 updates old."""
    arrays = m.logistic_data(num_rows=30)
    data = nf.FederatedData.from_groups(np.arange(30) % 3, **arrays)
    model = nf.federate(m.logistic, silos="data")
    fit = nf.PVI(model, schedule="asynchronous", order="random", max_staleness=2)
    return fit.federation(data), data


def simulated(
    fed: Federation, silo_data, roots, rng_key, num_rounds, available, groups=None
):
    """The same run through runtime/simulate.py (runtime/groups.py for silos in
    ``groups`` of equal structure, ``silo_data`` then a list of each silo's;
    runtime/events.py for a federation with a schedule), keys drawn as the silos
    draw them: ``fed.exchanges`` contract rounds on each round's keys."""
    alg = fed.algorithm
    rng_key, init_key = jax.random.split(rng_key)
    server = alg.init_server(init_key)
    scalar = jax.ShapeDtypeStruct((), roots.dtype)
    init_keys = jax.vmap(lambda r: silo_key(r, -1, scalar))(roots)
    if groups is None:
        silos = jax.vmap(alg.init_silo)(init_keys, silo_data)
        round_fn = jax.jit(partial(simulate_round, alg))
    else:
        states = [
            alg.init_silo(k, d) for k, d in zip(init_keys, silo_data, strict=True)
        ]
        silos, silo_data = stack_groups(states, groups), stack_groups(silo_data, groups)
        round_fn = jax.jit(partial(group_round, alg, groups))
    infos = []
    for t in range(num_rounds):
        if t % fed.exchanges == 0:
            next_key, server_key = fed.round_keys(rng_key)
            keys = jax.vmap(partial(silo_key, like=fed.silo_key_like), (0, None))(
                roots, t // fed.exchanges
            )
            if groups is not None:
                keys = stack_groups(list(keys), groups)
        if fed.schedule is not None:  # a pass of events on the round's silo keys
            next_key, server_key = fed.schedule(rng_key)
            lag = int(np.max(server_key.staleness))
            round_fn = jax.jit(partial(event_round, alg, max_staleness=lag))
        if (t + 1) % fed.exchanges == 0:
            rng_key = next_key
        server, silos, info = round_fn(
            server, silos, silo_data, server_key, keys, jnp.asarray(available(t))
        )
        infos.append(info)
    return server, infos


# Every algorithm goes through these halves in tests/runtime/test_flower.py; here
# the broadcast-only, the select-one-silo and the silos-of-different-structure shapes
@pytest.mark.parametrize("name", ["sfvi", "dsgld", "vertical_sfvi"])
def test_remote_round_equals_simulated_round(name):
    case = CASES[name]()
    fed = federation_of(case)
    per_silo = silo_list(case)
    silo_data = per_silo if case.groups else silo_data_of(case.data)
    roots = jax.random.split(jax.random.key(11), fed.num_silos)
    # silo 1 is unreachable in round 1: it must count as not taking part
    available = lambda t: np.arange(fed.num_silos) != (1 if t == 1 else -1)  # noqa: E731
    num_rounds = NUM_ROUNDS * fed.exchanges
    remote, remote_infos = run_remote(
        fed, per_silo, list(roots), jax.random.key(5), num_rounds, available=available
    )
    sim, sim_infos = simulated(
        fed, silo_data, roots, jax.random.key(5), num_rounds, available, case.groups
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
    with pytest.raises(
        TemplateMismatch, match=rf"silo 2's reply: field {re.escape(name)} is"
    ):
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
    fit = nf.SFVI(
        model, nf.AutoGlobalLocalNormal(model), optax.adam(0.05), num_particles=2
    )
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


def test_a_pass_of_events_equals_the_events_runtime():
    """``PVI(schedule="asynchronous")``'s federation carries its schedule: the remote
    server visits one silo at a time in the pass's random order, each with a message
    up to 2 updates old, as runtime/events.py does with the same keys; silo 2 out of
    reach in pass 1 is skipped."""
    fed, data = pvi_asynchronous()
    assert fed.schedule is not None
    silo_data = silo_data_of(data)
    roots = jax.random.split(jax.random.key(11), fed.num_silos)
    available = lambda t: np.arange(fed.num_silos) != (2 if t == 1 else -1)  # noqa: E731
    per_silo = [take(silo_data, j) for j in range(fed.num_silos)]
    remote, remote_infos = run_remote(
        fed, per_silo, list(roots), jax.random.key(5), NUM_ROUNDS, available=available
    )
    sim, sim_infos = simulated(
        fed, silo_data, roots, jax.random.key(5), NUM_ROUNDS, available
    )
    m.tree_allclose(remote, sim, rtol=1e-6, atol=1e-8)
    for a, b in zip(remote_infos, sim_infos, strict=True):
        assert np.shape(a.loss) == (fed.num_silos,)  # one loss per event
        m.tree_allclose(a.loss, b.loss, rtol=1e-6, atol=1e-8)
    # the passes really are asynchronous: some event read a stale message
    rng_key, lags = jax.random.split(jax.random.key(5))[0], []
    for _ in range(NUM_ROUNDS):
        rng_key, schedule = fed.schedule(rng_key)
        lags.extend(np.asarray(schedule.staleness).tolist())
    assert max(lags) > 0, lags


def test_vertical_sfvi_gives_its_federation():
    """``VerticalSFVI.federation(data)``: one data layout per party (each under its
    own names) and two exchanges per round (Algorithm 1's phases on one round's
    keys); a remote run equals the grouped runtime with the parties' own keys, and
    the parties' data and states differ in structure."""
    import optax

    model, data = vertical_problem()
    fit = nf.VerticalSFVI(model, nf.VerticalFamily(), optax.adam(0.05))
    fed = fit.federation(data)
    assert fed.exchanges == 2 and len(fed.silo_spec) == fed.num_silos == 3
    assert [list(s.arrays) for s in fed.silo_spec] == [["a"], ["b"], ["c"]]
    per_silo = silo_list(CASES["vertical_sfvi"]())  # each party's view, own names
    roots = jax.random.split(jax.random.key(2), 3)
    everyone = lambda t: np.ones(3, bool)  # noqa: E731
    groups = ((0,), (1,), (2,))
    remote, _ = run_remote(fed, per_silo, list(roots), jax.random.key(0), 4)
    sim, _ = simulated(fed, per_silo, roots, jax.random.key(0), 4, everyone, groups)
    m.tree_allclose(remote, sim, rtol=1e-10, atol=1e-12)
    assert int(remote.phase) == 0  # two whole iterations
    states = [
        jax.eval_shape(fed.algorithm.init_silo, jax.random.key(0), s)
        for s in fed.silo_spec
    ]
    # what a vmap over silos could not carry: data of three structures, states of
    # more than one shape
    assert len({jax.tree.structure(spec) for spec in fed.silo_spec}) == 3
    assert len({str(jax.tree.map(np.shape, x.raw)) for x in states}) > 1
