# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The same checks for every algorithm factory (STYLE.md rule 14): jitted equals
eager, a vmap over silos equals a loop, round 2 compiles nothing, float64 survives,
no message leaf is shaped like a silo's units (nor flagged by ``nf.audit``), a
non-finite reply is rejected while the run goes on, and the generic runtimes run it
with no algorithm named.

Each case builds an algorithm from a factory and the states and keys of one round;
adding an algorithm means adding one case."""

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.algorithms.fedgvi import fedgvi, gce_loss
from numpyro_fed.algorithms.pvi import pvi
from numpyro_fed.algorithms.sfvi import sfvi
from numpyro_fed.algorithms.sfvi_avg import sfvi_avg
from numpyro_fed.densities import data_template
from numpyro_fed.elbo import noise_keys
from numpyro_fed.protocol import FederatedAlgorithm, jit_algorithm, silo_data_of
from numpyro_fed.runtime import (
    event_round,
    event_schedule,
    round_bytes,
    sequential_round,
    simulate_round,
)
from numpyro_fed.util import all_finite, take
from tests import _models as m


class Case(NamedTuple):
    """- **algorithm** - the factory's output.
    - **data** - the silos' :class:`~numpyro_fed.FederatedData` (units padded to a
      size that no parameter has, so a unit axis in a message is detectable).
    - **server_key** / **silo_keys** - one round's keys.
    - **poison** - ``(silo_data, j) -> silo_data`` with silo j's data made non-finite.
    """

    algorithm: FederatedAlgorithm
    data: Any
    server_key: Any
    silo_keys: Any
    poison: Callable


def _hierarchical_data():
    # 13 groups over 3 silos (5, 4, 4 units): no parameter has 4 or 5 entries.
    arrays = m.hierarchical_data(num_groups=13, num_obs=6)
    return nf.FederatedData.from_groups(m.split_groups(13, 3), **arrays)


def _poison_y(silo_data, j):
    y = silo_data.arrays["y"].at[j].set(jnp.nan)
    return silo_data._replace(arrays={**silo_data.arrays, "y": y})


def _structured(data):
    fed = nf.federate(m.hierarchical, silos="group")
    guide = nf.AutoStructured(fed)
    guide.setup(data)
    return fed, guide


def case_sfvi() -> Case:
    data = _hierarchical_data()
    fed, guide = _structured(data)
    algorithm = sfvi(fed, guide, optax.adam(1e-2), data_template(data.silo(0)))
    keys = noise_keys(jax.random.key(3), 1)
    silo_keys = jnp.broadcast_to(keys, (data.num_silos,) + keys.shape)
    return Case(algorithm, data, keys, silo_keys, _poison_y)


def case_sfvi_avg() -> Case:
    data = _hierarchical_data()
    fed, guide = _structured(data)
    algorithm = sfvi_avg(
        fed,
        guide,
        optax.adam(1e-2),
        data_template(data.silo(0)),
        data.num_units,
        local_steps=2,
    )
    keys = jax.vmap(lambda k: noise_keys(k, 1))(jax.random.split(jax.random.key(3), 2))
    silo_keys = jnp.broadcast_to(keys, (data.num_silos,) + keys.shape)
    return Case(algorithm, data, keys, silo_keys, _poison_y)


def _pvi_case(factory, **options) -> Case:
    # tau's HalfNormal prior is not Gaussian: the server refines t_0 as well.
    data = _hierarchical_data()
    fed, guide = _structured(data)
    algorithm = factory(
        fed,
        guide,
        optax.adam(1e-2),
        data_template(data.silo(0)),
        num_silos=data.num_silos,
        local_steps=2,
        damping=0.5,
        prior_of=None,
        **options,
    )
    silo_keys = jax.random.split(jax.random.key(3), data.num_silos)
    return Case(algorithm, data, jax.random.key(4), silo_keys, _poison_y)


def case_pvi() -> Case:
    return _pvi_case(pvi)


def case_fedgvi() -> Case:
    return _pvi_case(fedgvi, loss=gce_loss(0.5))


def _sgld_case(kernel) -> Case:
    # The chain visits one silo a round: select names it.
    data = _normal_normal_data()
    algorithm = kernel(data).algorithm(data, steps_per_contact=3)
    silo_keys = jax.random.split(jax.random.key(3), data.num_silos)
    return Case(algorithm, data, jax.random.key(4), silo_keys, _poison_y)


def _normal_normal_data():
    y = np.random.default_rng(5).normal(size=(13, 6))
    return nf.FederatedData.from_groups(m.split_groups(13, 3), y=y)


def case_fsgld() -> Case:
    fed = nf.federate(m.normal_normal, silos="group")
    return _sgld_case(
        lambda data: nf.FSGLD(fed, 1e-3, nf.fit_surrogates(fed, data), tau=3)
    )


def case_dsgld() -> Case:
    fed = nf.federate(m.normal_normal, silos="group")
    return _sgld_case(lambda data: nf.DSGLD(fed, 1e-3, tau=3))


CASES = {
    "sfvi": case_sfvi,
    "sfvi_avg": case_sfvi_avg,
    "pvi": case_pvi,
    "fedgvi": case_fedgvi,
    "fsgld": case_fsgld,
    "dsgld": case_dsgld,
}


class Prepared(NamedTuple):
    """A case with its initial states and one compiled simulated round."""

    case: Case
    args: tuple
    round_fn: Callable
    result: tuple


@pytest.fixture(params=sorted(CASES), scope="module")
def prepared(request):
    case = CASES[request.param]()
    algorithm = case.algorithm
    server = jax.jit(algorithm.init_server)(jax.random.key(0))
    keys = jax.random.split(jax.random.key(1), case.data.num_silos)
    silo_data = silo_data_of(case.data)
    silos = jax.jit(jax.vmap(algorithm.init_silo))(keys, silo_data)
    args = (server, silos, silo_data, case.server_key, case.silo_keys)
    round_fn = jax.jit(partial(simulate_round, algorithm))
    return Prepared(case, args, round_fn, round_fn(*args))


def test_jit_equals_eager(prepared):
    with jax.disable_jit():
        eager = simulate_round(prepared.case.algorithm, *prepared.args)
    m.tree_allclose(prepared.result[:2], eager[:2], rtol=1e-9, atol=1e-12)


def test_vmap_equals_loop(prepared):
    looped = sequential_round(jit_algorithm(prepared.case.algorithm), *prepared.args)
    m.tree_allclose(prepared.result, looped, rtol=1e-10, atol=1e-12)


def test_second_round_compiles_nothing(prepared):
    server, silos, _ = prepared.result
    size = prepared.round_fn._cache_size()
    prepared.round_fn(server, silos, *prepared.args[2:])
    assert prepared.round_fn._cache_size() == size


def test_float64_survives(prepared):
    server, silos = prepared.args[:2]
    for before, after in zip(
        jax.tree.leaves((server, silos)),
        jax.tree.leaves(prepared.result[:2]),
        strict=True,
    ):
        assert after.dtype == before.dtype
        if jnp.issubdtype(before.dtype, jnp.floating):
            assert after.dtype == jnp.float64


def test_no_message_leaf_has_a_unit_axis(prepared):
    """Shapes only (nothing runs): neither direction carries a silo's unit axis."""
    case = prepared.case
    server, silos, silo_data, server_key, silo_keys = prepared.args
    algorithm = case.algorithm
    message = jax.eval_shape(algorithm.server_message, server, server_key)
    reply = jax.eval_shape(
        lambda m, s, d, k: algorithm.silo_step(m.at(0), take(s, 0), take(d, 0), k[0])[
            0
        ],
        message,
        silos,
        silo_data,
        silo_keys,
    )
    units = {case.data.padded_size, *case.data.sizes}
    for leaf in jax.tree.leaves((message, reply)):
        assert not units.intersection(leaf.shape), leaf.shape
    sizes = round_bytes(algorithm, server, silos, silo_data, server_key, silo_keys)
    assert sizes.down > 0 and sizes.reply > 0


def test_audit_flags_no_leaf(prepared):
    """``nf.audit`` on every algorithm: each direction carries something, no leaf
    grows with a silo's units, and its bytes are the accounting's."""
    case = prepared.case
    report = nf.audit(
        case.algorithm,
        case.data,
        server_key=case.server_key,
        silo_key=case.silo_keys[0],
    )
    assert report.flagged == (), str(report)
    assert report.small_silos == ()  # every silo holds 4 or 5 units
    server, silos, silo_data, server_key, silo_keys = prepared.args
    sizes = round_bytes(case.algorithm, server, silos, silo_data, server_key, silo_keys)
    assert report.bytes("server -> silo") == sizes.down > 0
    assert report.bytes("silo -> server") == sizes.reply > 0


def test_non_finite_reply_is_rejected_and_the_run_goes_on(prepared):
    """Silo j's data turn non-finite (j = 1, or the one silo the server contacts):
    its reply is rejected and counted, the server state and the other silos stay
    finite."""
    server, silos, silo_data, server_key, silo_keys = prepared.args
    algorithm, num_silos = prepared.case.algorithm, prepared.case.data.num_silos
    contacted = np.asarray(algorithm.select(server, server_key, num_silos))
    bad_silo = 1 if contacted.all() else int(np.argmax(contacted))
    bad = prepared.case.poison(silo_data, bad_silo)
    new_server, new_silos, info = prepared.round_fn(
        server, silos, bad, server_key, silo_keys
    )
    expected = np.arange(num_silos) == bad_silo
    assert np.asarray(info.rejected).tolist() == expected.tolist()
    assert bool(all_finite(new_server))
    for j in np.flatnonzero(~expected):
        assert bool(all_finite(take(new_silos, j)))


def test_rejected_reply_counts_as_a_silo_that_did_not_take_part(prepared):
    """The non-finite guard's promise, exactly: a round in which silo j's reply is
    rejected ends in the same states, bit for bit, as the round in which silo j was
    not contacted (its data poisoned or not)."""
    server, silos, silo_data, server_key, silo_keys = prepared.args
    algorithm, num_silos = prepared.case.algorithm, prepared.case.data.num_silos
    contacted = np.asarray(algorithm.select(server, server_key, num_silos))
    bad_silo = 1 if contacted.all() else int(np.argmax(contacted))
    bad = prepared.case.poison(silo_data, bad_silo)
    absent = jnp.arange(num_silos) != bad_silo
    poisoned = prepared.round_fn(server, silos, bad, server_key, silo_keys)
    without = prepared.round_fn(server, silos, silo_data, server_key, silo_keys, absent)
    m.tree_allclose(poisoned[:2], without[:2], rtol=1e-13, atol=1e-15)


def test_events_runtime_runs_it(prepared):
    case = prepared.case
    server, silos, silo_data, _, silo_keys = prepared.args
    schedule = event_schedule(jax.random.key(5), case.data.num_silos, max_staleness=1)
    keys = jnp.stack([case.server_key] * case.data.num_silos)
    schedule = schedule._replace(server_keys=keys)
    server, silos, infos = jax.jit(
        partial(event_round, case.algorithm, max_staleness=1)
    )(server, silos, silo_data, schedule, silo_keys)
    assert np.shape(infos.loss) == (case.data.num_silos,)
    assert bool(all_finite((server, silos)))


def test_summed_replies_equal_the_per_silo_path(prepared):
    """An algorithm that offers ``reduce_silos`` (SFVI) gives the same round, to
    rounding, as its replies stepped one per silo and summed by the server: with
    every silo, with some, and with one silo's data non-finite (the sum is then
    recomputed per silo, so only that silo is left out)."""
    algorithm = prepared.case.algorithm
    if algorithm.reduce_silos is None:
        pytest.skip("the algorithm's server does not read a sum of the replies")
    server, silos, silo_data, server_key, silo_keys = prepared.args
    per_silo = jax.jit(partial(simulate_round, algorithm, reduce=False))
    some = jnp.arange(prepared.case.data.num_silos) != 0
    bad = prepared.case.poison(silo_data, 1)
    for data, participating in ((silo_data, None), (silo_data, some), (bad, None)):
        args = (server, silos, data, server_key, silo_keys, participating)
        summed = prepared.round_fn(*args)
        m.tree_allclose(summed, per_silo(*args), rtol=1e-12, atol=1e-14)
    assert np.asarray(summed[2].rejected).tolist() == [False, True, False]
