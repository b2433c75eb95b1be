# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Faults in one silo never change the others' result silently (issue 19): the run
reports every rejected reply, stops naming a silo that fails too often, takes no
step without data, and refuses learning rates that cannot work."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.guard import SiloFailure, check_rejections, finite_rows, guarded_sum
from numpyro_fed.protocol import reply_sum
from tests import _models as m
from tests.vertical import _fixtures as fx


def _data(overflow_silo=None):
    """9 groups over 3 silos; ``overflow_silo``'s first observation is so large that
    its log density overflows (finite data, a non-finite local fit)."""
    y = np.random.default_rng(0).normal(size=(9, 4))
    groups = m.split_groups(9, 3)
    if overflow_silo is not None:
        y[np.flatnonzero(groups == overflow_silo)[0], 0] = 1e300
    return nf.FederatedData.from_groups(groups, y=jnp.asarray(y))


def _sfvi(**options):
    fed = nf.federate(m.normal_normal, silos="group")
    return nf.SFVI(fed, nf.AutoMeanField(fed), optax.adam(0.05), **options)


def _sfvi_avg(**options):
    fed = nf.federate(m.normal_normal, silos="group")
    return nf.SFVIAvg(
        fed, nf.AutoMeanField(fed), optax.adam(0.05), local_steps=2, **options
    )


def _pvi(**options):
    fed = nf.federate(m.normal_normal, silos="group")
    return nf.PVI(fed, local_steps=2, **options)


FITS = {"sfvi": _sfvi, "sfvi_avg": _sfvi_avg, "pvi": _pvi}


@pytest.mark.parametrize("name", sorted(FITS))
def test_silo_rejected_every_round_stops_the_run_naming_it(name):
    fit = FITS[name]()
    with pytest.raises(SiloFailure, match=r"replies of silo 2 were") as err:
        fit.run(jax.random.key(0), 20, _data(overflow_silo=2), progress_bar=False)
    assert err.value.silos == [2]
    assert err.value.rejected.tolist() == [0, 0, 20]
    # Nothing computed is lost, and the bad silo never touched it.
    assert bool(nf.util.all_finite(err.value.result.state.server))


@pytest.mark.parametrize("name", sorted(FITS))
def test_tolerated_rejections_are_named_in_a_warning(name):
    fit = FITS[name](max_rejected=None)
    with pytest.warns(UserWarning, match=r"silo 2 \(20 of 20 rounds\)"):
        result = fit.run(
            jax.random.key(0), 20, _data(overflow_silo=2), progress_bar=False
        )
    assert np.asarray(result.history["rejected"]).sum(0).tolist() == [0, 0, 20]
    assert bool(nf.util.all_finite(result.state.server))


def test_a_clean_run_neither_warns_nor_stops():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _sfvi().run(jax.random.key(0), 5, _data(), progress_bar=False)


def test_rejections_count_against_the_rounds_a_silo_was_contacted_in():
    """FSGLD contacts one silo a round: a silo rejected at every visit fails, though
    it was rejected in a small fraction of all rounds."""
    rejected = np.zeros((40, 4), bool)
    contacted = np.zeros((40, 4), bool)
    contacted[np.arange(40), np.arange(40) % 4] = True
    rejected[:, 3] = contacted[:, 3]
    history = {"rejected": rejected, "contacted": contacted}
    with pytest.raises(SiloFailure, match=r"silo 3 \(10 of 10 rounds\)"):
        check_rejections("FSGLD", history, 0.25)


@pytest.mark.parametrize("name", sorted(FITS))
def test_a_round_without_any_silo_moves_nothing(name):
    """SFVI used to step its server on the prior's gradient alone (1.741 -> 1.347 in
    100 such rounds on a conjugate model); PVI moved its hyperparameters."""
    fit, data = FITS[name](), _data()
    state = fit.init(jax.random.key(0), data)
    new, _ = fit.update(state, data, participating=jnp.zeros(data.num_silos, bool))
    m.tree_allclose(new.server, state.server, rtol=0, atol=0)
    m.tree_allclose(new.silos, state.silos, rtol=0, atol=0)


@pytest.mark.parametrize("cls", [nf.SFVI, nf.SFVIAvg], ids=["sfvi", "sfvi_avg"])
@pytest.mark.parametrize(
    "optim, problem",
    [
        (optax.adam(float("nan")), "NaN or infinite"),
        (optax.sgd(float("inf")), "NaN or infinite"),
        (optax.adam(-1e-2), "must be positive"),
        (optax.sgd(-0.1), "must be positive"),
    ],
    ids=["adam-nan", "sgd-inf", "adam-negative", "sgd-negative"],
)
def test_learning_rates_that_cannot_work_are_refused(cls, optim, problem):
    """They used to run into NaNs, or into parameters frozen at their start."""
    fed = nf.federate(m.normal_normal, silos="group")
    with pytest.raises(ValueError, match=problem):
        cls(
            fed,
            nf.AutoMeanField(fed),
            optim,
            **({"local_steps": 2} if cls is nf.SFVIAvg else {}),
        )


def test_pvi_refuses_a_nan_local_learning_rate():
    fed = nf.federate(m.normal_normal, silos="group")
    with pytest.raises(ValueError, match="local_optim.*NaN"):
        nf.PVI(fed, local_optim=optax.adam(float("nan")))


def test_a_schedule_that_starts_at_zero_is_accepted():
    fed = nf.federate(m.normal_normal, silos="group")
    warmup = optax.linear_schedule(0.0, 0.05, 100)
    nf.SFVI(fed, nf.AutoMeanField(fed), optax.adam(warmup))


# ------------------------------------------------------------------- vertical FL
def _vertical(poisoned_party=None, **options):
    """Gaussian vertical fixture; ``poisoned_party``'s replies turn NaN (a fault
    injected into that party's step, as a crashing local fit would)."""
    vfl = nf.VerticalSFVI(
        nf.augment(fx.gaussian_model(), fx.RHO),
        nf.VerticalFamily(),
        optax.adam(0.02),
        vmap_parties=False,
        **options,
    )
    if poisoned_party is not None:
        make = vfl._make_algorithm

        def poisoned(data):
            algorithm = make(data)

            def silo_step(message, state, silo_data, key):
                reply, new = algorithm.silo_step(message, state, silo_data, key)
                if poisoned_party in silo_data.arrays:
                    reply = reply._replace(z=reply.z * jnp.nan)
                return reply, new

            return algorithm._replace(silo_step=silo_step)

        vfl._make_algorithm = poisoned
    return vfl


def test_vertical_party_fault_moves_no_one_and_is_named():
    """A party's non-finite reply used to spread to every party in the next round;
    now the iteration is void (server and parties as they were) and the party is
    named."""
    data = fx.gaussian_data()
    bad = _vertical("b", max_rejected=None)
    # The party fails once the run is under way: init refuses a party whose first
    # reply is not finite (test_vertical_sfvi's T9).
    state = _vertical().init(jax.random.key(0), data)
    with pytest.warns(UserWarning, match=r"party 'b' \(2 of 2 rounds\)"):
        result = bad.run(
            jax.random.key(1), 2, data, init_state=state, progress_bar=False
        )
    m.tree_allclose(result.state.server, state.server, rtol=0, atol=0)
    m.tree_allclose(result.state.silos, state.silos, rtol=0, atol=0)
    assert np.asarray(result.history["rejected"]).tolist() == [[False, True, False]] * 2
    bad.max_rejected = 0.25  # the default: the same fault now stops the run
    with pytest.raises(SiloFailure, match="replies of party 'b' were"):
        bad.run(jax.random.key(1), 2, data, init_state=state, progress_bar=False)


def test_vertical_party_that_fails_at_init_is_refused_by_name():
    """A party whose first reply is not finite stops ``init`` with its name, before
    any run, whether it reads data it does not hold (T9) or its step fails."""
    with pytest.raises(nf.VerticalModelError, match=r"ELBO term of \['b'\]"):
        _vertical("b").init(jax.random.key(0), fx.gaussian_data())


# ------------------------------------------------------------------ FSGLD / DSGLD
@pytest.mark.parametrize(
    "step_size, problem",
    [
        (float("inf"), "positive finite number"),
        (float("nan"), "positive finite number"),
        (lambda t: 1e-3 * jnp.sqrt(1.0 - t / 4999.5), r"at t=\d+ it is nan"),
        (lambda t: 1e-3 - 1e-9 * t, r"at t=\d+ it is -"),
    ],
    ids=["inf", "nan", "schedule-turns-nan", "schedule-turns-negative"],
)
def test_step_sizes_that_cannot_work_are_refused(step_size, problem):
    fed = nf.federate(m.normal_normal, silos="group")
    with pytest.raises(ValueError, match=problem):
        nf.DSGLD(fed, step_size)


def test_fsgld_without_surrogates_is_not_silently_dsgld():
    fed = nf.federate(m.normal_normal, silos="group")
    with pytest.raises(TypeError, match="use nf.DSGLD"):
        nf.FSGLD(fed, 1e-3, None)


def _stacked(rng, num_silos):
    """Replies and states with a leading silo axis, and an integer leaf (as an
    optimizer's step count) that the guard must not read."""
    replies = (
        jnp.asarray(rng.normal(size=num_silos)),
        {"g": jnp.asarray(rng.normal(size=(num_silos, 3, 2)))},
    )
    states = {
        "loc": jnp.asarray(rng.normal(size=(num_silos, 4))),
        "count": jnp.arange(num_silos),
    }
    return replies, states


@pytest.mark.parametrize(
    "fault",
    ["none", "reply", "state", "uncontacted", "overflow"],
)
def test_guarded_sum_is_the_per_silo_rule_bit_for_bit(fault):
    """The round's sum skips the per-silo checks only when that cannot change
    anything: with every silo finite, one NaN reply or state, a NaN in a silo that
    was not contacted, and finite replies whose sum overflows, it gives exactly
    (same bits) the per-silo rule's ``used``, states and sum over ``used``."""
    rng = np.random.default_rng(0)
    replies, stepped = _stacked(rng, 5)
    _, states = _stacked(rng, 5)
    contacted = jnp.array([True, True, True, False, True])
    if fault == "overflow":
        g = replies[1]["g"]
        replies[1]["g"] = jnp.full_like(g, jnp.finfo(g.dtype).max / 2)
    elif fault == "reply":
        replies[1]["g"] = replies[1]["g"].at[2, 1, 0].set(jnp.nan)
    elif fault == "state":
        stepped["loc"] = stepped["loc"].at[4, 3].set(-jnp.inf)
    elif fault == "uncontacted":
        stepped["loc"] = stepped["loc"].at[3, 0].set(jnp.nan)
    used, total, kept = jax.jit(guarded_sum)(contacted, replies, stepped, states)
    expected_used, expected_kept = finite_rows(contacted, replies, stepped, states)
    expected = (expected_used, reply_sum(replies, expected_used), expected_kept)
    for got, want in zip(
        jax.tree.leaves((used, total, kept)), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    dropped = {"none": [], "reply": [2], "state": [4], "uncontacted": []}
    if fault in dropped:
        left_out = np.flatnonzero(np.asarray(contacted & ~used)).tolist()
        assert left_out == dropped[fault]
    else:
        assert not np.isfinite(np.asarray(total[1]["g"])).all()
