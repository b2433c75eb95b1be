# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""VerticalSFVI: J = 1 and exchangeability (T10), minibatch unbiasedness and the
row-index check (T12), local steps (T16), and parties vmapped when their blocks are
equal."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer.util import log_density
import optax
import pytest

import numpyro_fed as nf
from numpyro_fed.algorithms.vertical_sfvi import (
    AuxGrad,
    AuxSample,
    RowIndexMismatchError,
    VerticalBroadcast,
    VerticalPartyState,
    check_row_hashes,
    name_key_data,
    vertical_sfvi,
)
from numpyro_fed.protocol import Message
from numpyro_fed.vertical.data import row_hash
from numpyro_fed.vertical.structure import SERVER
from numpyro_fed.vertical.terms import standard_noise
from tests.vertical import _fixtures as fx

SIGMA = 0.7


def linear_model(order=("a", "b"), subsample=None, prior_scales=None):
    """Parties ``order`` (blocks traced in that order), each ``x_{party} @ beta``;
    a server intercept; Gaussian likelihood with known noise. ``subsample``: the
    rows plate's subsample size (one plate object: the same indices everywhere)."""
    scales = prior_scales or {}

    def model(y=None, **xs):
        n = y.shape[0]
        rows = numpyro.plate("rows", n, subsample_size=subsample)
        b = numpyro.sample("b", dist.Normal(0.0, 1.0))
        eta = {}
        for k in order:
            x = xs[f"x_{k}"]
            with nf.vertical(k):
                beta = numpyro.sample(
                    f"beta_{k}",
                    dist.Normal(0.0, scales.get(k, 1.0))
                    .expand([x.shape[1]])
                    .to_event(1),
                )
                with rows as idx:
                    eta[k] = nf.contribution(k, x[idx] @ beta)
        with rows as idx:
            mean = b + sum(eta[k] for k in sorted(eta))  # a fixed order of the sum
            numpyro.sample("y", dist.Normal(mean, SIGMA), obs=y[idx])

    return model


def linear_data(widths, n=20, seed=0, perm=None, labels="server"):
    rng = np.random.default_rng(seed)
    xs = {k: rng.normal(size=(n, w)) for k, w in sorted(widths.items())}
    y = 0.2 + sum(x @ rng.normal(size=x.shape[1]) for x in xs.values())
    y = y + SIGMA * rng.normal(size=n)
    perm = np.arange(n) if perm is None else perm
    return nf.VerticalData(
        {k: {f"x_{k}": jnp.asarray(x[perm])} for k, x in xs.items()},
        {"y": jnp.asarray(y[perm])},
        labels=labels,
    )


def fresh_state(vfl, data, key=0, scale=0.3):
    """A perturbed initial state without running (compiling) a round."""
    vfl.setup(data)
    key = jax.random.key(key)
    parties = {}
    for i, p in enumerate(vfl.structure.parties):
        raw = vfl.family.init(p, jax.random.fold_in(key, i))
        raw = jax.tree.map(
            lambda x, i=i: (
                x
                + scale
                * jax.random.normal(jax.random.fold_in(key, 100 + i), jnp.shape(x))
            ),
            raw,
        )
        slots = jnp.arange(len(vfl.structure.parties), dtype=jnp.int32)
        parties[p] = VerticalPartyState(raw, vfl._optims_by_owner[p].init(raw), slots)
    server = vfl._make_algorithm(data).init_server(key)
    return vfl.state_of(server, parties, jax.random.key(3), data)


def _by_party(vfl, state):
    """The state with its parties in their own layouts (whatever their grouping)."""
    return state.server, vfl.party_states(state), state.rng_key


def assert_trees_close(a, b, tol):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
            x, y = jax.random.key_data(x), jax.random.key_data(y)
        scale = max(float(jnp.max(jnp.abs(y))), 1.0)
        assert float(jnp.max(jnp.abs(x - y))) <= tol * scale


# ------------------------------------------------------------------------ T10
def one_party(x, y=None):
    with nf.vertical("a"):
        beta = numpyro.sample("beta", dist.Normal(0.0, 1.5).expand([2]).to_event(1))
        with numpyro.plate("rows", x.shape[0]):
            eta = nf.contribution("a", x @ beta)
    with numpyro.plate("rows", x.shape[0]):
        numpyro.sample("y", dist.Normal(eta, SIGMA), obs=y)


def _one_party_data(n=30):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(n, 2))
    y = x @ np.array([1.0, -0.5]) + SIGMA * rng.normal(size=n)
    return nf.VerticalData({"a": {"x": jnp.asarray(x)}}, {"y": jnp.asarray(y)})


def _conjugate_one(data, noise_var, tau=1.5):
    x, y = data.arrays["x"], data.arrays["y"]
    prec = x.T @ x / noise_var + jnp.eye(2) / tau**2
    cov = jnp.linalg.inv(prec)
    return cov @ x.T @ y / noise_var, cov


def test_t10_one_party_augmented_is_conjugate_with_noise_sigma2_plus_rho2():
    data, rho = _one_party_data(), 0.4
    mean, cov = fx.quadratic_posterior(
        nf.augment(one_party, rho), data, ["beta", "a/z"]
    )
    ref_mean, ref_cov = _conjugate_one(data, SIGMA**2 + rho**2)
    assert jnp.max(jnp.abs(mean[:2] - ref_mean)) < 1e-10
    assert jnp.max(jnp.abs(cov[:2, :2] - ref_cov)) < 1e-10
    wrong, _ = _conjugate_one(data, SIGMA**2 + 2 * rho**2)  # J rho^2 with J = 2
    assert jnp.max(jnp.abs(mean[:2] - wrong)) > 1e-4


def test_t10_one_party_power_log_joint_over_theta_is_the_original():
    # J = 1: the copy uses the exact g_1 and no z; z_1 is an unused auxiliary whose
    # density integrates to one, so the log joint over theta is the original's.
    data, rho = _one_party_data(), 0.4
    arrays = data.pooled()
    power = nf.augment(one_party, rho, "power")
    rng = np.random.default_rng(0)
    for _ in range(3):
        beta = jnp.asarray(rng.normal(size=2))
        z = jnp.asarray(rng.normal(size=30))
        lp = log_density(power, (), arrays, {"beta": beta, "a/z": z})[0]
        lp_z = dist.Normal(arrays["x"] @ beta, rho).log_prob(z).sum()
        orig = log_density(one_party, (), arrays, {"beta": beta})[0]
        assert abs(lp - lp_z - orig) < 1e-10 * abs(orig)
    mean, cov = fx.quadratic_posterior(power, data, ["beta", "a/z"])
    ref_mean, ref_cov = _conjugate_one(data, SIGMA**2)
    assert jnp.max(jnp.abs(mean[:2] - ref_mean)) < 1e-10
    assert jnp.max(jnp.abs(cov[:2, :2] - ref_cov)) < 1e-10


def test_t10_party_keys_depend_on_names_only():
    fam = nf.VerticalFamily(hidden=(3,))
    keys = {}
    for names in (("a", "b", "c"), ("b", "c", "d")):
        widths = dict(zip(names, (2, 1, 3), strict=True))
        vfl = nf.VerticalSFVI(nf.augment(linear_model(names), 0.5), fam, optax.sgd(0.1))
        vfl.setup(linear_data(widths))
        keys[names] = vfl.round_keys(jax.random.key(0))[1].party_keys
    for p in ("b", "c"):  # a renamed party does not move the others' noise
        assert jnp.all(
            jax.random.key_data(keys["a", "b", "c"][p])
            == jax.random.key_data(keys["b", "c", "d"][p])
        )
    assert name_key_data("a") != name_key_data("b")


@pytest.mark.slow
def test_t10_row_permutation_leaves_results_unchanged():
    widths, n, steps = {"a": 2, "b": 1}, 20, 5
    family = nf.VerticalFamily(aux="amortized", hidden=(3,))
    data = linear_data(widths, n)

    def fit(model, data, noise=None, vfl=None):
        if vfl is None:
            vfl = nf.VerticalSFVI(nf.augment(model, 0.5), family, optax.sgd(0.02))
        state = fresh_state(vfl, data)
        if noise is not None:  # the same rounds with the noise permuted like the rows
            vfl._make_algorithm = lambda data: vertical_sfvi(
                vfl.model,
                vfl.family,
                vfl.structure,
                vfl._optims_by_owner,
                data.view(SERVER),
                noise=noise(standard_noise(vfl.family, vfl.structure)),
            )
        return vfl.run(None, steps, data, progress_bar=False, init_state=state), vfl

    ref, vfl = fit(linear_model(("a", "b")), data)
    # rows permuted at every party and at the server, noise permuted accordingly
    perm = np.random.default_rng(1).permutation(n)

    def permuted(base):
        def noise(owner, key):
            eps, tau = base(owner, key)
            return eps, None if tau is None else tau[perm]

        return noise

    data_perm = linear_data(widths, n, perm=perm)
    rows, _ = fit(linear_model(("a", "b")), data_perm, permuted)
    assert_trees_close(rows.state, ref.state, 1e-10)
    assert jnp.max(jnp.abs(rows.losses - ref.losses)) < 1e-10 * jnp.max(
        jnp.abs(ref.losses)
    )
    # without permuting the noise the rounds differ: the check has power
    plain, _ = fit(None, data_perm, vfl=vfl)  # compiled already: new data only
    assert jnp.max(jnp.abs(plain.losses - ref.losses)) > 1e-3


# ------------------------------------------------------------------------ T12
@pytest.mark.slow
def test_t12_minibatch_elbo_is_unbiased_with_shared_rows():
    widths, n, batch, keys = {"a": 2, "b": 1}, 40, 10, 2000
    data = linear_data(widths, n)
    family = nf.VerticalFamily(aux="amortized", hidden=(3,))
    means = {}
    for sub in (batch, None):
        vfl = nf.VerticalSFVI(
            nf.augment(linear_model(subsample=sub), 0.5), family, optax.sgd(0.0)
        )
        state = fresh_state(vfl, data)  # the same parameters for both
        raws = {
            SERVER: state.server.raw,
            **{p: s.raw for p, s in vfl.party_states(state).items()},
        }
        if sub is not None:
            assert vfl.structure.z_scale == n / batch

        # the round's single-sample ELBO (its rows and noise from the key), which
        # the protocol's loss equals (T5)
        def elbo(k, vfl=vfl, raws=raws):
            return vfl.joint_elbo(raws, k, data)

        draws = jax.jit(jax.vmap(elbo))(jax.random.split(jax.random.key(0), keys))
        means[sub] = (float(draws.mean()), float(draws.std() / keys**0.5))
    (m_mb, se_mb), (m_full, se_full) = means[batch], means[None]
    se = (se_mb**2 + se_full**2) ** 0.5
    assert abs(m_mb - m_full) < 3 * se, (means, se)
    # power: dropping the n/B scale would move the mean by a quarter of the
    # likelihood, far more than 3 SE
    assert 3 * se < 0.05 * abs(m_full)


def test_t12_row_hash_check():
    idx = jnp.array([4, 1, 7])
    good = {p: AuxSample(jnp.zeros(3), row_hash(idx)) for p in ("a", "b")}
    check_row_hashes(good, idx)
    check_row_hashes({"a": AuxSample(jnp.zeros(3))}, None)  # full batch: no check
    bad = {**good, "b": AuxSample(jnp.zeros(3), row_hash(idx[::-1]))}
    with pytest.raises(RowIndexMismatchError, match=r"\['b'\]"):
        check_row_hashes(bad, idx)
    with pytest.raises(RowIndexMismatchError, match="no row-index hash"):
        check_row_hashes({"a": AuxSample(jnp.zeros(3))}, idx)


def _deviating_party(vfl):
    honest = vfl._make_algorithm

    def deviating(data):  # party b uses other rows than the shared ones
        alg = honest(data)

        def silo_step(message, state, silo, key):
            if "b" in silo.arrays:
                b = message.broadcast
                message = message._replace(broadcast=b._replace(idx=jnp.roll(b.idx, 1)))
            return alg.silo_step(message, state, silo, key)

        return alg._replace(silo_step=silo_step)

    vfl._make_algorithm = deviating
    vfl._built = {}


def _subsampled():
    data = linear_data({"a": 2, "b": 1}, 40)
    vfl = nf.VerticalSFVI(
        nf.augment(linear_model(subsample=10), 0.5),
        nf.VerticalFamily(hidden=(3,)),
        optax.sgd(0.01),
    )
    return vfl, data, fresh_state(vfl, data)


def test_t12_runtime_raises_when_a_party_uses_other_rows():
    vfl, data, state = _subsampled()
    vfl.update(state, data)  # honest rounds pass the check
    _deviating_party(vfl)
    with pytest.raises(RowIndexMismatchError, match=r"\['b'\]"):
        vfl.update(state, data)


@pytest.mark.slow
def test_t12_run_raises_when_a_party_uses_other_rows_inside_a_scan():
    vfl, data, state = _subsampled()
    _deviating_party(vfl)
    with pytest.raises(RowIndexMismatchError, match=r"\['b'\]"):
        vfl.run(None, 200, data, progress_bar=False, init_state=state)


# ------------------------------------------------------------------------ T16
def test_t16_local_steps_hold_the_server_gradient_fixed():
    data = linear_data({"a": 2, "b": 1})
    aug = nf.augment(linear_model(), 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the default warns about nothing
        one = nf.VerticalSFVI(aug, nf.VerticalFamily(hidden=(3,)), optax.adam(0.05))
    with pytest.warns(UserWarning, match="approximate") as record:
        three = nf.VerticalSFVI(
            aug, nf.VerticalFamily(hidden=(3,)), optax.adam(0.05), local_steps=3
        )
    assert len(record) == 1
    state = fresh_state(one, data)
    fresh_state(three, data)
    party = one.party_states(state)["a"]
    _, r = one.round_keys(state.rng_key)
    grad = AuxGrad(jax.random.normal(jax.random.key(5), (20,)))
    # the update phase (1) of Algorithm 1, with the server's gradient routed to a
    message = Message(VerticalBroadcast(jnp.int32(1), r.idx, (), {}), grad)
    upd1 = jax.jit(one._make_algorithm(data).silo_step)
    upd3 = jax.jit(three._make_algorithm(data).silo_step)
    args = (one._party_data(data, "a"), r.party_keys["a"])
    first, s = upd1(message, party, *args)
    for _ in range(2):  # two more steps, same noise, same server gradient
        _, s = upd1(message, s, *args)
    reply3, s3 = upd3(message, party, *args)
    assert_trees_close(s3, s, 1e-12)
    # reported at the round's parameters
    assert float(reply3.elbo) == float(first.elbo)
    assert (
        float(
            jnp.max(jnp.abs(s3.raw["loc"] - upd1(message, party, *args)[1].raw["loc"]))
        )
        > 1e-3
    )
    with pytest.raises(ValueError, match="local_steps"):
        nf.VerticalSFVI(aug, nf.VerticalFamily(), optax.adam(0.1), local_steps=0)
    with pytest.raises(TypeError, match="local_steps"):
        nf.VerticalSFVI(aug, nf.VerticalFamily(), optax.adam(0.1), local_steps=2.0)


# ----------------------------------------------------------- vmapped parties
def _fit(model, data, family, vmap, steps=4, kind="augmented", optim=None):
    vfl = nf.VerticalSFVI(
        nf.augment(model, 0.5, kind),
        family,
        optim or optax.adam(0.02),
        vmap_parties=vmap,
    )
    result = vfl.run(jax.random.key(0), steps, data, progress_bar=False)
    return vfl, result


# Slow: test_equal_shapes_with_different_code_are_not_vmapped keeps one vmapped run in the default suite.
@pytest.mark.slow
def test_t10_vmapped_and_looped_parties_agree_in_any_block_order():
    # a and b have equal blocks (vmapped together); c is wider (its own call). The
    # looped run traces the blocks in another order: party keys come from names.
    widths = {"a": 2, "b": 2, "c": 3}
    data = linear_data(widths)
    family = nf.VerticalFamily(aux="amortized", hidden=(3,))
    vmapped, r1 = _fit(linear_model(("a", "b", "c")), data, family, True)
    looped, r2 = _fit(linear_model(("c", "a", "b")), data, family, False)
    assert vmapped.party_groups == (("a", "b"), ("c",))
    assert looped.party_groups == (("a",), ("b",), ("c",))
    # a second init on the same instance starts every party in its own layout
    again = vmapped.run(jax.random.key(0), 4, data, progress_bar=False)
    assert_trees_close(_by_party(vmapped, again.state), _by_party(vmapped, r1.state), 0)
    assert_trees_close(_by_party(vmapped, r1.state), _by_party(looped, r2.state), 1e-12)
    assert jnp.max(jnp.abs(r1.losses - r2.losses)) < 1e-12 * jnp.max(jnp.abs(r2.losses))


def test_equal_shapes_with_different_code_are_not_vmapped():
    # b's prior differs from a's: same shapes, different ELBO term (the probe)
    model = linear_model(("a", "b"), prior_scales={"b": 2.0})
    data = linear_data({"a": 2, "b": 2})
    vfl = nf.VerticalSFVI(
        nf.augment(model, 0.5), nf.VerticalFamily(hidden=(3,)), optax.adam(0.02)
    )
    state = fresh_state(vfl, data)
    vfl._find_groups(vfl.party_states(state), data, state.rng_key)
    assert vfl.party_groups == (("a",), ("b",))
    same = nf.VerticalSFVI(
        nf.augment(linear_model(("a", "b")), 0.5),
        nf.VerticalFamily(hidden=(3,)),
        optax.adam(0.02),
    )
    state = fresh_state(same, data)
    same._find_groups(same.party_states(state), data, state.rng_key)
    assert same.party_groups == (("a", "b"),)
    # a party's own optimizer keeps it apart without a probe
    own = nf.VerticalSFVI(
        nf.augment(linear_model(("a", "b")), 0.5),
        nf.VerticalFamily(hidden=(3,)),
        {"a": optax.adam(0.02), "b": optax.adam(0.01), "server": optax.adam(0.02)},
    )
    state = fresh_state(own, data)
    own._find_groups(own.party_states(state), data, state.rng_key)
    assert own.party_groups == (("a",), ("b",))


@pytest.mark.slow
def test_power_likelihood_vmapped_parties_agree_with_the_loop():
    widths = {"a": 2, "b": 2, "c": 2}
    model = linear_model(("a", "b", "c"))
    data = linear_data(widths, labels="shared")
    family = nf.VerticalFamily(aux="meanfield", hidden=(3,))
    vmapped, r1 = _fit(model, data, family, True, kind="power")
    looped, r2 = _fit(model, data, family, False, kind="power")
    assert vmapped.party_groups == (("a", "b", "c"),)
    assert_trees_close(_by_party(vmapped, r1.state), _by_party(looped, r2.state), 1e-12)
