# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""VerticalSFVI: the ELBO partition (T4), protocol gradients (T5), privacy by
NaN-poisoning and the message audit (T8), label placement (T9), guide size (T11)."""

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers
from numpyro.infer import Trace_ELBO
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.algorithms.vertical_sfvi import AuxGrad, AuxSample
from numpyro_fed.protocol import jit_algorithm
from numpyro_fed.util import stack
from numpyro_fed.vertical.structure import (
    SERVER,
    fill_values,
    owner_log_density,
    owners,
)
from tests.vertical import _fixtures as fx


def _raws(vfl, state):
    parties = vfl.party_states(state)
    return {SERVER: state.server.raw, **{p: s.raw for p, s in parties.items()}}


def _perturbed(vfl, state, data, scale=0.3):
    """Move every parameter off its initialization (zero last layers, zero
    off-diagonals), so that every gradient path is exercised."""
    states = vfl.party_states(state)
    leaves, tree = jax.tree.flatten(
        (state.server.raw, {p: s.raw for p, s in states.items()})
    )
    keys = jax.random.split(jax.random.key(42), len(leaves))
    leaves = [
        x + scale * jax.random.normal(k, x.shape)
        for x, k in zip(leaves, keys, strict=True)
    ]
    server, parties = jax.tree.unflatten(tree, leaves)
    return vfl.state_of(
        state.server._replace(raw=server),
        {p: s._replace(raw=parties[p]) for p, s in states.items()},
        state.rng_key,
        data,
    )


def _max_rel(a, b):
    a, b = jax.tree.leaves(a), jax.tree.leaves(b)
    scale = max(float(jnp.max(jnp.abs(x))) for x in b)
    return (
        max(float(jnp.max(jnp.abs(x - y))) for x, y in zip(a, b, strict=True)) / scale
    )


FAMILIES = [
    ("augmented", "amortized", "full"),
    pytest.param("augmented", "meanfield", "diag", marks=pytest.mark.slow),
    pytest.param("power", "amortized", "diag", marks=pytest.mark.slow),
    ("power", "meanfield", "full"),
]


@pytest.mark.parametrize(
    "kind,aux,cov",
    FAMILIES,
    ids=[
        "aug-amortized-full",
        "aug-meanfield-diag",
        "power-amortized-diag",
        "power-meanfield-full",
    ],
)
def test_t5_protocol_gradients_equal_joint_autodiff(kind, aux, cov):
    labels = "shared" if kind == "power" else "server"
    data = fx.rich_data(labels=labels)
    aug = nf.augment(fx.rich_model, 0.5, kind)
    family = nf.VerticalFamily(aux=aux, theta_cov=cov, hidden=(4,))
    # the update is the gradient; local_steps=1 (the default, T16) is Algorithm 1/2
    vfl = nf.VerticalSFVI(aug, family, optax.sgd(1.0), local_steps=1)
    state = _perturbed(vfl, vfl.init(jax.random.key(1), data), data)
    new, loss = vfl.update(state, data)
    protocol = jax.tree.map(lambda n, o: n - o, _raws(vfl, new), _raws(vfl, state))
    value, joint = jax.jit(jax.value_and_grad(lambda r, k: vfl.joint_elbo(r, k, data)))(
        _raws(vfl, state), state.rng_key
    )
    assert abs(float(loss) + float(value)) < 1e-10 * abs(float(value))
    assert _max_rel(protocol, joint) < 1e-6


@pytest.mark.slow
def test_t5_mutation_a_fresh_draw_at_the_update_biases_the_gradient():
    data = fx.rich_data()
    vfl = nf.VerticalSFVI(
        nf.augment(fx.rich_model, 0.5),
        nf.VerticalFamily(hidden=(4,)),
        optax.sgd(1.0),
        runtime="sequential",
    )
    state = _perturbed(vfl, vfl.init(jax.random.key(0), data), data)
    alg = jit_algorithm(vfl._make_algorithm(data))  # the jitted pure functions
    parties = vfl.party_states(state)
    silo_data = {p: vfl._party_data(data, p) for p in ("a", "b")}
    _, server_key, keys = vfl._round_keys(state.rng_key, 2)
    keys = dict(zip(("a", "b"), keys, strict=True))
    send = alg.server_message(state.server, server_key)  # phase 0: the z_j
    replies = [
        alg.silo_step(send.at(j), parties[p], silo_data[p], keys[p])[0]
        for j, p in enumerate(("a", "b"))
    ]
    server, _ = alg.server_step(
        state.server, stack(replies), server_key, jnp.ones(2, bool)
    )
    grads = alg.server_message(server, server_key)  # phase 1: the gradients
    joint = jax.jit(jax.grad(lambda r, k: vfl.joint_elbo(r, k, data)))(
        _raws(vfl, state), state.rng_key
    )
    for key, close in ((keys["a"], True), (jax.random.key(99), False)):
        _, new = alg.silo_step(grads.at(0), parties["a"], silo_data["a"], key)
        diff = jax.tree.map(lambda n, o: n - o, new.raw, parties["a"].raw)
        assert (_max_rel(diff, joint["a"]) < 1e-6) == close


def test_t4_elbo_partition_equals_numpyro_trace_elbo():
    data = fx.rich_data(placeholder=None)
    aug = nf.augment(fx.rich_model, 0.5)
    vfl = nf.VerticalSFVI(aug, nf.VerticalFamily(hidden=(4,)), optax.adam(0.05))
    state = _perturbed(vfl, vfl.init(jax.random.key(0), data), data)
    raws = _raws(vfl, state)
    guide = vfl.numpyro_guide(raws)
    arrays = data.pooled()
    params = handlers.trace(handlers.seed(guide, 0)).get_trace(**arrays)
    param_map = {k: s["value"] for k, s in params.items() if s["type"] == "param"}
    param_map["w_a"] = vfl.family.constrain("a", raws["a"])["param"]["w_a"]
    key = jax.random.key(7)
    loss = Trace_ELBO().loss(key, param_map, aug, guide, **arrays)
    # the same draws (Trace_ELBO seeds the guide with the second half of the key),
    # split by owner
    g_tr = handlers.trace(
        handlers.seed(
            handlers.substitute(guide, data=param_map), jax.random.split(key)[1]
        )
    ).get_trace(**arrays)
    values = {
        k: s["value"]
        for k, s in g_tr.items()
        if s["type"] == "sample" and not k.startswith("_vfl")
    }
    values["w_a"] = param_map["w_a"]
    log_q = sum(
        s["fn"].log_prob(s["value"]).sum()
        for s in g_tr.values()
        if s["type"] == "sample"
    )
    full = fill_values(vfl.structure, values)
    terms = {o: owner_log_density(aug, o, full, arrays) for o in ("a", "b", SERVER)}
    assert abs(sum(terms.values()) - log_q + loss) < 1e-8 * abs(float(loss))
    # each term reads only its own sites
    m_tr = handlers.trace(handlers.substitute(aug, data=full)).get_trace(**arrays)
    assert owners(m_tr) == {
        "b": SERVER, "sigma": SERVER, "y": SERVER,
        "s_a": "a", "beta_a": "a", "w_a": "a", "a/z": "a",
        "beta_b": "b", "b/z": "b",
    }  # fmt: skip


def test_t8_nan_poisoned_views_leave_everything_bit_identical_and_messages_audit():
    vfl = nf.VerticalSFVI(
        nf.augment(fx.rich_model, 0.5),
        nf.VerticalFamily(hidden=(4,)),
        {"a": optax.adam(0.02), "b": optax.sgd(1e-3), "server": optax.adam(0.01)},
        runtime="sequential",
        record_messages=True,
    )
    steps = 20
    poisoned = vfl.run(jax.random.key(3), steps, fx.rich_data(), progress_bar=False)
    messages = list(vfl.messages)
    clean = vfl.run(
        jax.random.key(3), steps, fx.rich_data(placeholder=None), progress_bar=False
    )
    assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(poisoned))
    for a, b in zip(jax.tree.leaves(poisoned), jax.tree.leaves(clean), strict=True):
        assert bool(jnp.all(a == b))
    assert len(messages) == len(vfl.messages) == steps * 4
    kinds = set()
    for (_, s, r, m), (_, s2, r2, m2) in zip(messages, vfl.messages, strict=True):
        assert (s, r) == (s2, r2) and bool(jnp.all(m[0] == m2[0]))
        # only z_j and its gradient cross: one number per row, and the party's
        # scalar ELBO term for the loss trace (the row-index hash is None: every
        # round uses every row)
        assert isinstance(m, (AuxSample, AuxGrad))
        assert m[0].shape == (12,)
        if isinstance(m, AuxSample):
            assert m.row_hash is None and m.elbo.shape == () and m.cross == ()
        kinds.add((type(m).__name__, s == SERVER))
    assert kinds == {("AuxSample", False), ("AuxGrad", True)}


@pytest.mark.slow
def test_t8_simulate_runtime_on_poisoned_views_equals_sequential():
    """The simulation runtime (one jitted round) computes the sequential runtime's
    rounds on NaN-poisoned views (slow: it compiles the whole round twice; the
    default run checks simulate against sequential in tests/runtime/test_groups.py)."""
    make = partial(
        nf.VerticalSFVI,
        nf.augment(fx.rich_model, 0.5),
        nf.VerticalFamily(hidden=(4,)),
        {"a": optax.adam(0.02), "b": optax.sgd(1e-3), "server": optax.adam(0.01)},
    )
    runs = [
        make(runtime=runtime).run(
            jax.random.key(3), 20, fx.rich_data(), progress_bar=False
        )
        for runtime in ("sequential", "simulate")
    ]
    for a, b in zip(*map(jax.tree.leaves, runs), strict=True):
        assert jnp.allclose(a, b, rtol=1e-9, atol=1e-12)


def test_t9_power_likelihood_is_refused_when_labels_stay_at_the_server():
    vfl = nf.VerticalSFVI(
        nf.augment(fx.rich_model, 0.5, "power"), nf.VerticalFamily(), optax.adam(0.01)
    )
    with pytest.raises(ValueError, match="labels='server'"):
        vfl.init(jax.random.key(0), fx.rich_data(labels="server"))


def test_t9_a_party_term_that_reads_the_labels_is_caught():
    # In the default run: once the non-finite guard dropped the leaking party's
    # reply, this check went silent, unnoticed while it ran only under -m slow.
    import numpyro
    import numpyro.distributions as dist

    def leaky(x_a, x_b, y=None):  # party a's block reads y, which it does not hold
        with nf.vertical("a"):
            beta = numpyro.sample("beta_a", dist.Normal(0, 1).expand([2]).to_event(1))
            with numpyro.plate("rows", x_a.shape[0]):
                e_a = nf.contribution("a", x_a @ beta + 0.1 * y)
        with nf.vertical("b"):
            beta = numpyro.sample("beta_b", dist.Normal(0, 1).expand([3]).to_event(1))
            with numpyro.plate("rows", x_b.shape[0]):
                e_b = nf.contribution("b", x_b @ beta)
        with numpyro.plate("rows", x_a.shape[0]):
            numpyro.sample("y", dist.Normal(e_a + e_b, 1), obs=y)

    vfl = nf.VerticalSFVI(nf.augment(leaky, 0.5), nf.VerticalFamily(), optax.adam(0.01))
    with pytest.raises(nf.VerticalModelError, match=r"\['a'"):
        vfl.init(jax.random.key(0), fx.rich_data())


def test_t11_amortized_guide_size_does_not_grow_with_n():
    sizes = {}
    for aux in ("amortized", "meanfield"):
        for n in (100, 10_000):
            vfl = nf.VerticalSFVI(
                nf.augment(fx.rich_model, 0.5),
                nf.VerticalFamily(aux=aux, theta_cov="full"),
                optax.adam(0.01),
            )
            vfl.setup(fx.rich_data(n=n))
            fam = vfl.family
            sizes[aux, n] = {
                p: sum(
                    np.size(x) for x in jax.tree.leaves(fam.init(p, jax.random.key(0)))
                )
                for p in ("a", "b")
            }
    assert sizes["amortized", 100] == sizes["amortized", 10_000]
    # mean-field: 2n per party on top of q(theta_j) (d + d + d*d) and the param
    for n in (100, 10_000):
        assert sizes["meanfield", n] == {
            "a": 2 * n + 3 + 3 + 9 + 1,
            "b": 2 * n + 3 + 3 + 9,
        }


def test_bad_construction_arguments():
    aug = nf.augment(fx.rich_model, 0.5)
    with pytest.raises(TypeError, match="augmented model"):
        nf.VerticalSFVI(fx.rich_model, nf.VerticalFamily(), optax.adam(0.1))
    with pytest.raises(TypeError, match="VerticalFamily"):
        nf.VerticalSFVI(aug, object(), optax.adam(0.1))
    with pytest.raises(TypeError, match="optax"):
        nf.VerticalSFVI(aug, nf.VerticalFamily(), 0.1)
    with pytest.raises(ValueError, match="runtime"):
        nf.VerticalSFVI(aug, nf.VerticalFamily(), optax.adam(0.1), runtime="flower")
    vfl = nf.VerticalSFVI(aug, nf.VerticalFamily(), {"a": optax.adam(0.1)})
    with pytest.raises(ValueError, match=r"no optimizer for \['b', 'server'\]"):
        vfl.init(jax.random.key(0), fx.rich_data())
    with pytest.raises(TypeError, match="VerticalData"):
        vfl.init(jax.random.key(0), fx.rich_data().pooled())
    with pytest.raises(ValueError, match="aux must be"):
        nf.VerticalFamily(aux="structured")
