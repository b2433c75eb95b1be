# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Bad inputs get an error that names the argument, field, party or array; valid
inputs that look unusual (NumPy integers as step counts, 0/1 masks) are taken
(issue 19). Each case ran silently, or failed deep inside JAX or NumPyro, before."""

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer import MCMC
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.runtime.checkpoint import checkpoint_steps, save_checkpoint
from tests import _models as m
from tests.infer.test_resume_fresh import MAKE, assert_same_tree
from tests.vertical import _fixtures as fx

FED = nf.federate(m.normal_normal, silos="group")


def _data(groups=(0, 0, 1, 1, 2, 2, 2), seed=0):
    """Silos of groups (normal_normal): local latents padded to the largest silo."""
    y = np.random.default_rng(seed).normal(size=(len(groups), 3)) + 1.0
    return nf.FederatedData.from_groups(np.asarray(groups), y=y)


def _vertical():
    return nf.VerticalSFVI(
        nf.augment(fx.gaussian_model(), 0.5), nf.VerticalFamily(), optax.adam(0.05)
    )


# ------------------------------------------------------------- participation
@pytest.mark.parametrize("name", sorted(MAKE))
def test_a_participation_mask_must_be_one_boolean_per_silo(name):
    algo, data = MAKE[name](), _data()
    state = algo.init(jax.random.key(0), data)
    with pytest.raises(ValueError, match=r"the data hold 3 silos.*got \(2,\)"):
        algo.update(state, data, jnp.array([True, False]))
    with pytest.raises(ValueError, match=r"got \(3, 1\)"):
        algo.update(state, data, np.ones((3, 1), bool))
    # before: cast to bool, so 2 and 0.5 silently meant "takes part"
    with pytest.raises(ValueError, match=r"booleans .*got \[0, 1, 2\]"):
        algo.update(state, data, np.array([0, 1, 2]))
    with pytest.raises(ValueError, match=r"booleans .*got \[0.5, 1.0, 1.0\]"):
        algo.update(state, data, [0.5, 1.0, 1.0])


def test_a_zero_one_mask_is_the_boolean_mask():
    algo, data = MAKE["SFVI"](), _data()
    state = algo.init(jax.random.key(0), data)
    assert_same_tree(
        algo.update(state, data, np.array([1, 0, 1])),
        algo.update(state, data, np.array([True, False, True])),
    )


# ------------------------------------------------------- state of another layout
@pytest.mark.parametrize("name", sorted(MAKE))
def test_a_state_of_another_data_layout_is_refused_naming_the_field(name):
    """Before: a TypeError from inside the round ("mul got incompatible shapes for
    broadcasting: (3, 2), (4, 2)"), on the same object and on a fresh one."""
    algo, data = MAKE[name](), _data()  # 3 silos of at most 3 groups
    state = algo.init(jax.random.key(0), data)
    wider = _data((0, 0, 0, 0, 1, 2, 2))  # 3 silos of at most 4 groups
    field = (
        r"state\.silos\.eta_local\['loc'\] has shape \(3, 3, 1\) .* needs \(3, 4, 1\)"
    )
    for fresh in (algo, MAKE[name]()):
        with pytest.raises(ValueError, match=f"{name}: {field}"):
            fresh.update(state, wider)
        with pytest.raises(ValueError, match="init\\(key, data\\) on these data"):
            fresh.run(jax.random.key(0), 2, wider, init_state=state)
    fewer = _data((0, 0, 1, 1, 1, 1, 1))  # 2 silos
    with pytest.raises(ValueError, match="state holds 3 silos but the data hold 2"):
        algo.update(state, fewer)
    with pytest.raises(TypeError, match="needs the FederatedState .* got RunResult"):
        algo.update(algo.run(jax.random.key(0), 1, data, progress_bar=False), data)


def test_a_state_carries_over_to_other_data_of_its_layout():
    """The check is on the layout only: new values of the same shapes are taken."""
    algo, data = MAKE["SFVI"](), _data()
    state = algo.init(jax.random.key(0), data)
    _, loss = algo.update(state, _data(seed=1))
    assert jnp.isfinite(loss)


def test_a_vertical_state_of_other_rows_or_another_algorithm_is_refused():
    """Before: "zip() argument 2 is shorter than argument 1"."""
    vfl, data = _vertical(), fx.gaussian_data()
    state = vfl.init(jax.random.key(0), data)
    fewer = fx.gaussian_data(n=30)
    field = r"state\.\w+.* has shape \(.*40.*\) .* needs \(.*30.*\)"
    for fresh in (vfl, _vertical()):
        with pytest.raises(ValueError, match=f"VerticalSFVI: {field}"):
            fresh.update(state, fewer)
    sfvi = MAKE["SFVI"]()
    other = sfvi.init(jax.random.key(0), _data())
    with pytest.raises(ValueError, match="not a run's state .* parties \\['a', 'b'"):
        vfl.update(other, data)


@pytest.mark.parametrize("kernel", ["FSGLD", "DSGLD"])
def test_a_chain_of_another_data_layout_is_refused_naming_the_site(kernel):
    """Before: the step ran on misaligned silos; only ArviZ-style postprocessing
    failed later (or "Incompatible shapes for broadcasting: [(4,), (6,)]")."""
    data, other = _data(), _data((0, 0, 0, 0, 1, 2, 2))

    surrogates = {}

    def make(data):
        if kernel == "DSGLD":
            return nf.DSGLD(FED, 1e-3)
        if id(data) not in surrogates:
            surrogates[id(data)] = nf.fit_surrogates(FED, data, prior_power=0.3)
        return nf.FSGLD(FED, 1e-3, surrogates[id(data)])

    sampler = make(data)
    state = sampler.init(jax.random.key(0), 0, None, (data,), {})
    wider = make(other)
    wider.init(jax.random.key(0), 0, None, (other,), {})
    site = rf"{kernel}: state\.z\['b'\] has shape \(3, 3, 1\) .* needs \(3, 4, 1\)"
    with pytest.raises(ValueError, match=site):
        wider.sample(state, (other,), {})
    # through MCMC: a warm state carried to data of another layout
    mcmc = MCMC(make(data), num_warmup=0, num_samples=2, progress_bar=False)
    mcmc.run(jax.random.key(1), data)
    mcmc.post_warmup_state = mcmc.last_state
    with pytest.raises(ValueError, match=site):
        mcmc.run(mcmc.post_warmup_state.rng_key, other)
    # without local latents only the silos' keys tell the silo count
    logistic = nf.federate(m.logistic, silos="data")
    rows = m.logistic_data(num_rows=12)
    two, three = (
        nf.FederatedData.from_groups(np.arange(12) % j, **rows) for j in (2, 3)
    )
    chain = nf.DSGLD(logistic, 1e-3).init(jax.random.key(0), 0, None, (two,), {})
    with pytest.raises(ValueError, match="silo_keys holds 2 .* data hold 3 silos"):
        nf.DSGLD(logistic, 1e-3).sample(chain, (three,), {})
    # a fresh kernel steps a saved state without init
    assert jnp.isfinite(make(data).sample(state, (data,), {}).z["mu"]).all()


# ------------------------------------------------------------- vertical data
def _vertical_arrays(party=None, label=None):
    rng = np.random.default_rng(0)
    xs = {k: rng.normal(size=(40, 2)) for k in fx.PARTIES}
    y = rng.normal(size=40)
    if party is not None:
        xs["b"][3, 1] = party
    if label is not None:
        y[5] = label
    return {k: {f"x_{k}": xs[k]} for k in fx.PARTIES}, {"y": y}


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
def test_non_finite_vertical_features_and_labels_are_named(bad):
    """Before: NumPyro's "Normal distribution got invalid loc parameter" (features)
    and a privacy-leak diagnosis (labels: "reads arrays ... its owner does not
    hold")."""
    parties, server = _vertical_arrays(party=bad)
    with pytest.raises(
        ValueError, match=r"'x_b' of party 'b' has 1 non-finite .*row 3"
    ):
        nf.VerticalData(parties, server)
    parties, server = _vertical_arrays(label=bad)
    with pytest.raises(ValueError, match=r"'y' of the server \(the labels\) .*row 5"):
        nf.VerticalData(parties, server)
    with pytest.raises(ValueError, match=r"'offset' of the public arrays"):
        nf.VerticalData(*_vertical_arrays(), public={"offset": np.full(40, bad)})


# ------------------------------------------------------------- NumPy step counts
@pytest.mark.parametrize("name", [*sorted(MAKE), "VerticalSFVI"])
def test_numpy_integers_are_step_counts(name, tmp_path):
    """Before: "num_steps must be a positive int, got np.int64(2)"."""
    if name == "VerticalSFVI":
        algo, data = _vertical(), fx.gaussian_data()
    else:
        algo, data = MAKE[name](), _data()
    key = jax.random.key(0)
    whole = algo.run(key, 2, data, progress_bar=False)
    numpy = algo.run(key, np.int64(2), data, progress_bar=False)
    assert_same_tree(numpy.state, whole.state)
    assert numpy.losses.shape == (2,)
    algo.run(
        key, np.int32(2), data, checkpoint_every=np.int64(1), checkpoint_dir=tmp_path
    )
    assert checkpoint_steps(tmp_path) == [1, 2]
    for bad, error in ((0, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(error, match=f"num_steps must be an int >= 1, got {bad}"):
            algo.run(key, bad, data)


def test_numpy_integers_are_taken_by_every_constructor_and_count():
    i = np.int64
    sfvi = nf.SFVI(FED, nf.AutoMeanField(FED), optax.adam(0.1), num_particles=i(2))
    avg = nf.SFVIAvg(FED, nf.AutoMeanField(FED), optax.adam(0.1), local_steps=i(3))
    pvi = nf.PVI(
        FED,
        local_steps=i(2),
        num_particles=i(2),
        schedule="asynchronous",
        max_staleness=i(1),
    )
    gvi = nf.FedGVI(FED, cavity_steps=i(4), divergence=("renyi", 0.5))
    vfl = nf.VerticalSFVI(
        nf.augment(fx.gaussian_model(), 0.5),
        nf.VerticalFamily(),
        optax.adam(0.1),
        local_steps=i(1),
    )
    counts = (sfvi.num_particles, avg.local_steps, pvi.local_steps, pvi.max_staleness)
    counts += (gvi.cavity_steps, vfl.local_steps)
    assert counts == (2, 3, 2, 1, 4, 1)
    assert all(type(c) is int for c in counts)
    with pytest.raises(
        ValueError, match=r"local_steps must be an int >= 1, got np.int64\(0\)"
    ):
        nf.SFVIAvg(FED, nf.AutoMeanField(FED), optax.adam(0.1), local_steps=i(0))
    with pytest.raises(TypeError, match="num_particles must be an int >= 1, got 1.5"):
        nf.PVI(FED, num_particles=1.5)


def test_numpy_integers_are_counts_of_kernels_surrogates_and_checkpoints(tmp_path):
    data = _data()
    q = nf.fit_surrogates(FED, data, num_steps=np.int64(50), prior_power=0.3)
    assert_same_tree(q, nf.fit_surrogates(FED, data, num_steps=50, prior_power=0.3))
    run = nf.DSGLD(FED, 1e-3, tau=np.int64(2)).run_protocol(
        jax.random.key(0), data, np.int64(3)
    )
    assert run.stats.rounds == 3 and run.stats.steps == 6
    save_checkpoint(tmp_path, {"x": jnp.ones(2)}, step=np.int64(3), keep=np.int64(1))
    assert checkpoint_steps(tmp_path) == [3]
