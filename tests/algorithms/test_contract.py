# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The same checks for every algorithm factory (STYLE.md rule 14): jitted equals
eager, a vmap over silos equals a loop, round 2 compiles nothing, float64 survives,
no message leaf is shaped like a silo's units (nor flagged by ``nf.audit``), a
non-finite reply is rejected while the run goes on, and the generic runtimes run it
with no algorithm named.

Each case builds an algorithm from a factory and the states and keys of one round;
adding an algorithm means adding one case. Vertical SFVI's parties are silos whose
data and states differ in structure: its case runs under the grouped runtime, and the
checks that stack every silo along one axis say why they do not apply to it."""

from functools import partial
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.algorithms.fedgvi import fedgvi, gce_loss
from numpyro_fed.algorithms.pvi import pvi
from numpyro_fed.algorithms.sfvi import sfvi
from numpyro_fed.algorithms.sfvi_avg import sfvi_avg
from numpyro_fed.algorithms.vertical_sfvi import num_phases, vertical_sfvi
from numpyro_fed.densities import data_template
from numpyro_fed.elbo import noise_keys
from numpyro_fed.protocol import (
    FederatedAlgorithm,
    SiloData,
    jit_algorithm,
    silo_data_of,
)
from numpyro_fed.runtime import (
    event_round,
    event_schedule,
    round_bytes,
    sequential_round,
    simulate_round,
)
from numpyro_fed.runtime.groups import group_round, stack_groups, unstack_groups
from numpyro_fed.util import all_finite, take
from numpyro_fed.vertical.structure import SERVER, vertical_structure
from tests import _models as m


class Case(NamedTuple):
    """- **algorithm** - the factory's output.
    - **data** - the silos' :class:`~numpyro_fed.FederatedData` (units padded to a
      size that no parameter has, so a unit axis in a message is detectable).
      With ``groups`` set: a tuple of each silo's own
      :class:`~numpyro_fed.protocol.SiloData`.
    - **server_key** / **silo_keys** - one round's keys.
    - **poison** - ``(silo_data, j) -> silo_data`` with silo j's data made non-finite
      (``silo_data`` as the case's round function takes it).
    - **groups** - ``None`` when the silos share one structure; else the silos in
      groups of equal structure (:func:`~numpyro_fed.runtime.groups.group_round`).
    - **exchanges** - contract rounds per round, on the round's keys.
    """

    algorithm: FederatedAlgorithm
    data: Any
    server_key: Any
    silo_keys: Any
    poison: Callable
    groups: tuple | None = None
    exchanges: int = 1


def silo_list(case: Case) -> list:
    """Each silo's own :class:`~numpyro_fed.protocol.SiloData`, in silo order."""
    if case.groups is not None:
        return list(case.data)
    stacked = silo_data_of(case.data)
    return [take(stacked, j) for j in range(case.data.num_silos)]


def _hierarchical_data():
    # 13 groups over 3 silos (5, 4, 4 units): no parameter has 4 or 5 entries.
    arrays = m.hierarchical_data(num_groups=13, num_obs=6)
    return nf.FederatedData.from_groups(m.split_groups(13, 3), **arrays)


def _poison_y(silo_data, j):
    y = silo_data.arrays["y"].at[j].set(jnp.nan)
    return silo_data._replace(arrays={**silo_data.arrays, "y": y})


def _structured(data):
    fed = nf.federate(m.hierarchical, silos="group")
    guide = nf.AutoGlobalLocalNormal(fed)
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


def _vertical_model(x_a, x_b, x_c, y=None):
    """Three parties of different structure: a hyperprior and 2 columns, 3 columns,
    one column; a server intercept."""
    b = numpyro.sample("b", dist.Normal(0.0, 1.0))
    with nf.vertical("a"):
        s = numpyro.sample("s_a", dist.HalfNormal(1.0))
        beta_a = numpyro.sample("beta_a", dist.Normal(0.0, s).expand([2]).to_event(1))
        with numpyro.plate("rows", x_a.shape[0]):
            e_a = nf.contribution("a", x_a @ beta_a)
    with nf.vertical("b"):
        beta_b = numpyro.sample("beta_b", dist.Normal(0.0, 1.0).expand([3]).to_event(1))
        with numpyro.plate("rows", x_b.shape[0]):
            e_b = nf.contribution("b", x_b @ beta_b)
    with nf.vertical("c"):
        beta_c = numpyro.sample("beta_c", dist.Normal(0.0, 1.0))
        with numpyro.plate("rows", x_c.shape[0]):
            e_c = nf.contribution("c", x_c * beta_c)
    with numpyro.plate("rows", x_a.shape[0]):
        numpyro.sample("y", dist.Normal(b + e_a + e_b + e_c, 0.5), obs=y)


def _poison_party(silo_data, j):
    # one group per party: group j is party j; its own columns turn non-finite
    group = silo_data[j]
    ((party, view),) = group.arrays.items()
    view = {k: jnp.full_like(v, jnp.nan) for k, v in view.items()}
    bad = group._replace(arrays={party: view})
    return silo_data[:j] + (bad,) + silo_data[j + 1 :]


def vertical_problem():
    """``(augmented model, VerticalData)``: 3 parties of different structure, 9 rows."""
    rng = np.random.default_rng(2)
    n = 9
    xs = {"a": rng.normal(size=(n, 2)), "b": rng.normal(size=(n, 3))}
    xs["c"] = rng.normal(size=n)
    y = xs["a"] @ [1.0, -0.5] + xs["b"] @ [0.5, 0.2, -1.0] - xs["c"]
    # zeros (not NaN) in the columns a party does not hold: the eager round meets
    # NumPyro's argument validation
    arrays = {p: {f"x_{p}": jnp.asarray(x)} for p, x in xs.items()}
    data = nf.VerticalData(arrays, {"y": jnp.asarray(y)}, placeholder=0.0)
    return nf.augment(_vertical_model, 0.3), data


def case_vertical_sfvi() -> Case:
    model, data = vertical_problem()
    n = data.num_rows
    structure = vertical_structure(model, data.pooled())
    family = nf.VerticalFamily()
    family.setup(structure, {p: model.rho_of(p) for p in structure.parties})
    owners = structure.parties + (SERVER,)
    optims = {o: optax.adam(1e-2) for o in owners}
    algorithm = vertical_sfvi(model, family, structure, optims, data.view(SERVER))
    silos = tuple(
        SiloData({p: data.view(p)}, jnp.ones((n,), bool), jnp.arange(n))
        for p in structure.parties
    )
    groups = tuple((j,) for j in range(len(silos)))
    silo_keys = jax.random.split(jax.random.key(3), len(silos))
    exchanges = num_phases(structure.kind)
    return Case(
        algorithm, silos, jax.random.key(4), silo_keys, _poison_party, groups, exchanges
    )


CASES = {
    "sfvi": case_sfvi,
    "sfvi_avg": case_sfvi_avg,
    "pvi": case_pvi,
    "fedgvi": case_fedgvi,
    "fsgld": case_fsgld,
    "dsgld": case_dsgld,
    "vertical_sfvi": case_vertical_sfvi,
}
#: Cases whose silos differ in structure (``Case.groups`` set): the runtimes that
#: stack every silo along one axis (simulate, events, sharded) do not carry them.
GROUPED = frozenset({"vertical_sfvi"})


class Prepared(NamedTuple):
    """A case with its initial states and one compiled round (simulated, or grouped
    for a case with ``groups``); ``round_py`` is the same round, not jitted."""

    case: Case
    args: tuple
    round_py: Callable
    round_fn: Callable
    result: tuple


def _not_for_grouped(prepared, why: str) -> None:
    if prepared.case.groups is not None:
        pytest.skip(f"silos of different structure ({prepared.case.groups}): {why}")


def _silo_states(prepared, silos) -> list:
    if prepared.case.groups is None:
        return [take(silos, j) for j in range(jax.tree.leaves(silos)[0].shape[0])]
    return unstack_groups(silos, prepared.case.groups)


@pytest.fixture(params=sorted(CASES), scope="module")
def prepared(request):
    case = CASES[request.param]()
    algorithm = case.algorithm
    server = jax.jit(algorithm.init_server)(jax.random.key(0))
    per_silo = silo_list(case)
    keys = jax.random.split(jax.random.key(1), len(per_silo))
    if case.groups is None:
        silo_data = silo_data_of(case.data)
        silos = jax.jit(jax.vmap(algorithm.init_silo))(keys, silo_data)
        silo_keys = case.silo_keys
        round_py = partial(simulate_round, algorithm)
    else:
        silo_data = stack_groups(per_silo, case.groups)
        init = jax.jit(algorithm.init_silo)
        states = [init(k, d) for k, d in zip(keys, per_silo, strict=True)]
        silos = stack_groups(states, case.groups)
        silo_keys = stack_groups(list(case.silo_keys), case.groups)
        round_py = partial(group_round, algorithm, case.groups)
    args = (server, silos, silo_data, case.server_key, silo_keys)
    round_fn = jax.jit(round_py)
    return Prepared(case, args, round_py, round_fn, round_fn(*args))


def test_jit_equals_eager(prepared):
    with jax.disable_jit():
        eager = prepared.round_py(*prepared.args)
    m.tree_allclose(prepared.result[:2], eager[:2], rtol=1e-9, atol=1e-12)


def test_vmap_equals_loop(prepared):
    _not_for_grouped(
        prepared,
        "no vmap over parties of different structure; group_round with one group "
        "per party is the loop",
    )
    looped = sequential_round(jit_algorithm(prepared.case.algorithm), *prepared.args)
    m.tree_allclose(prepared.result, looped, rtol=1e-10, atol=1e-12)


def test_second_round_compiles_nothing(prepared):
    """The second round (for vertical SFVI: its next phase) reuses the first's
    compiled program."""
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
    _not_for_grouped(
        prepared,
        "vertical FL's messages are per row by design (z_j and dL_0/dz_j, "
        "docs/vertical-fl.md)",
    )
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
    _not_for_grouped(
        prepared, "nf.audit reads FederatedData, and vertical messages are per row"
    )
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
    algorithm = prepared.case.algorithm
    num_silos = len(_silo_states(prepared, silos))
    contacted = np.asarray(algorithm.select(server, server_key, num_silos))
    bad_silo = 1 if contacted.all() else int(np.argmax(contacted))
    bad = prepared.case.poison(silo_data, bad_silo)
    new_server, new_silos, info = prepared.round_fn(
        server, silos, bad, server_key, silo_keys
    )
    expected = np.arange(num_silos) == bad_silo
    assert np.asarray(info.rejected).tolist() == expected.tolist()
    assert bool(all_finite(new_server))
    new_states = _silo_states(prepared, new_silos)
    for j in np.flatnonzero(~expected):
        assert bool(all_finite(new_states[j]))


def test_rejected_reply_counts_as_a_silo_that_did_not_take_part(prepared):
    """The non-finite guard's promise, exactly: a round in which silo j's reply is
    rejected ends in the same states, bit for bit, as the round in which silo j was
    not contacted (its data poisoned or not)."""
    server, silos, silo_data, server_key, silo_keys = prepared.args
    algorithm = prepared.case.algorithm
    num_silos = len(_silo_states(prepared, silos))
    contacted = np.asarray(algorithm.select(server, server_key, num_silos))
    bad_silo = 1 if contacted.all() else int(np.argmax(contacted))
    bad = prepared.case.poison(silo_data, bad_silo)
    absent = jnp.arange(num_silos) != bad_silo
    poisoned = prepared.round_fn(server, silos, bad, server_key, silo_keys)
    without = prepared.round_fn(server, silos, silo_data, server_key, silo_keys, absent)
    m.tree_allclose(poisoned[:2], without[:2], rtol=1e-13, atol=1e-15)


def test_events_runtime_runs_it(prepared):
    _not_for_grouped(
        prepared,
        "event_round keeps the silo states stacked along one axis; runtime/groups.py "
        "and the remote runtime (tests/runtime/test_flower.py) carry these",
    )
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
