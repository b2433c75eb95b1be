# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Marks and the augmented models: exact identities (T1, T2, T3) and bad input."""

import jax.numpy as jnp
import numpy as np
import numpyro
from numpyro import handlers
import numpyro.distributions as dist
from numpyro.infer.util import log_density
import pytest

import numpyro_fed as nf
from tests.vertical import _fixtures as fx

BETAS = [f"beta_{k}" for k in fx.PARTIES]
ZS = [f"{k}/z" for k in fx.PARTIES]


def test_marks_tag_sites_and_leave_the_model_unchanged():
    data = fx.gaussian_data()
    model = fx.gaussian_model()
    tr = handlers.trace(handlers.seed(model, 0)).get_trace(**data.pooled())
    assert tr["beta_b"]["fed"] == {"party": "b"}
    assert "fed" not in tr["y"]
    assert sorted(tr) == sorted(BETAS + ["rows", "y"])

    def plain(x_a, x_b, x_c, y):  # the same model, unmarked
        etas = []
        for k, x in zip(fx.PARTIES, (x_a, x_b, x_c), strict=True):
            beta = numpyro.sample(
                f"beta_{k}", dist.Normal(0, fx.TAU).expand([2]).to_event(1)
            )
            etas.append(x @ beta)
        with numpyro.plate("rows", x_a.shape[0]):
            numpyro.sample("y", dist.Normal(sum(etas), fx.SIGMA), obs=y)

    values = {k: tr[k]["value"] for k in BETAS}
    lp = log_density(model, (), data.pooled(), values)[0]
    assert lp == log_density(plain, (), data.pooled(), values)[0]


def test_t1_augmented_log_density_is_the_handwritten_one():
    data = fx.gaussian_data()
    aug = nf.augment(fx.gaussian_model(), fx.RHO)
    arrays = data.pooled()
    for seed in range(3):
        tr = handlers.trace(handlers.seed(aug, seed)).get_trace(**arrays)
        values = {k: tr[k]["value"] + 0.3 * seed for k in BETAS + ZS}
        expected = (
            dist.Normal(sum(values[z] for z in ZS), fx.SIGMA)
            .log_prob(arrays["y"])
            .sum()
        )
        for k in fx.PARTIES:
            g = arrays[f"x_{k}"] @ values[f"beta_{k}"]
            expected += dist.Normal(g, fx.RHO).log_prob(values[f"{k}/z"]).sum()
            expected += dist.Normal(0, fx.TAU).log_prob(values[f"beta_{k}"]).sum()
        got = log_density(aug, (), arrays, values)[0]
        assert abs(got - expected) < 1e-10


def test_t1_augmented_beta_marginal_is_conjugate_with_inflated_noise():
    data = fx.gaussian_data()
    aug = nf.augment(fx.gaussian_model(), fx.RHO)
    mean, cov = fx.quadratic_posterior(aug, data, BETAS + ZS)
    ref_mean, ref_cov = fx.conjugate(data, fx.SIGMA**2 + 3 * fx.RHO**2)
    assert jnp.max(jnp.abs(mean[:6] - ref_mean)) < 1e-10
    assert jnp.max(jnp.abs(cov[:6, :6] - ref_cov)) < 1e-10
    # rho is a standard deviation: reading it as a variance would fail this check
    wrong_mean, _ = fx.conjugate(data, fx.SIGMA**2 + 3 * fx.RHO)
    assert jnp.max(jnp.abs(mean[:6] - wrong_mean)) > 1e-3


def test_t2_rho_to_zero_is_monotone_and_power_is_closer():
    data = fx.gaussian_data()
    ref_mean, ref_cov = fx.conjugate(data, fx.SIGMA**2)
    errors = {"augmented": [], "power": []}
    for rho in (0.4, 0.1, 0.01, 1e-3):
        for kind in errors:
            aug = nf.augment(fx.gaussian_model(), rho, kind)
            mean, cov = fx.quadratic_posterior(aug, data, BETAS + ZS)
            err = max(
                jnp.max(jnp.abs(mean[:6] - ref_mean)),
                jnp.max(jnp.abs(cov[:6, :6] - ref_cov)),
            )
            errors[kind].append(float(err))
    for kind, errs in errors.items():
        assert all(a > b for a, b in zip(errs, errs[1:], strict=False)), (kind, errs)
        assert errs[-1] < 1e-5
    assert all(p < a for p, a in zip(errors["power"], errors["augmented"], strict=True))


def test_t3_power_copy_with_exact_contributions_is_the_original_likelihood():
    # With z_k := g_k every copy is the original likelihood; the J copies at weight
    # 1/J sum to it exactly.
    data = fx.gaussian_data()
    arrays = data.pooled()
    model = fx.gaussian_model()
    aug = nf.augment(model, fx.RHO, "power")
    tr = handlers.trace(handlers.seed(model, 3)).get_trace(**arrays)
    values = {k: tr[k]["value"] for k in BETAS}
    for k in fx.PARTIES:
        values[f"{k}/z"] = arrays[f"x_{k}"] @ values[f"beta_{k}"]
    aug_tr = handlers.trace(handlers.substitute(aug, data=values)).get_trace(**arrays)
    copies = sum(aug_tr[f"{k}/power_likelihood"]["fn"].log_factor for k in fx.PARTIES)
    assert abs(copies - tr["y"]["fn"].log_prob(arrays["y"]).sum()) < 1e-10


# ---------------------------------------------------------------- bad input
def _two_party(body_a=None, body_b=None, rows_b=None):
    def model(x, y=None):
        with nf.vertical("a"):
            beta = numpyro.sample("beta", dist.Normal(0, 1))
            e_a = (body_a or (lambda: nf.contribution("a", x * beta)))()
        with nf.vertical("b"):
            gamma = numpyro.sample("gamma", dist.Normal(0, 1))
            e_b = (body_b or (lambda: nf.contribution("b", x * gamma)))()
        with numpyro.plate("rows", x.shape[0]):
            numpyro.sample("y", dist.Normal(e_a + e_b, 1), obs=y)

    return model


def _trace(model, n=5):
    x = jnp.linspace(0, 1, n)
    return handlers.trace(handlers.seed(model, 0)).get_trace(x, jnp.ones(n))


def test_overlapping_party_blocks_are_refused():
    def model(x, y=None):
        with nf.vertical("a"):
            with nf.vertical("b"):
                numpyro.sample("beta", dist.Normal(0, 1))

    with pytest.raises(ValueError, match="Overlapping party blocks.*'b'.*'a'"):
        _trace(model)


def test_contribution_outside_its_block_is_refused():
    def model(x, y=None):
        with nf.vertical("a"):
            nf.contribution("b", x)

    with pytest.raises(ValueError, match=r"contribution\('b'.*inside vertical\('a'\)"):
        _trace(model)
    with pytest.raises(ValueError, match="outside any vertical block"):
        nf.contribution("a", jnp.ones(3))


def test_block_without_contribution_is_refused():
    model = _two_party(body_b=lambda: 0.0)
    with pytest.raises(nf.VerticalModelError, match=r"\['b'\] mark no nf.contribution"):
        _trace(nf.augment(model, 1.0))


def test_no_contribution_at_all_is_refused():
    def model(y):
        numpyro.sample("y", dist.Normal(0, 1), obs=y)

    with pytest.raises(nf.VerticalModelError, match="no nf.contribution"):
        handlers.seed(nf.augment(model, 1.0), 0)(jnp.ones(2))


def test_contribution_shape_mismatch_is_refused():
    model = _two_party(body_b=lambda: nf.contribution("b", jnp.ones((5, 1))))
    with pytest.raises(nf.VerticalModelError, match=r"'b'.*\(5, 1\).*'a'.*\(5,\)"):
        _trace(nf.augment(model, 1.0))


def test_contribution_shape_differs_from_the_predictor():
    def model(x, y=None):  # one party whose contribution is (n, 1): y is (n,)
        with nf.vertical("a"):
            beta = numpyro.sample("beta", dist.Normal(0, 1))
            e = nf.contribution("a", (x * beta)[:, None])
        numpyro.sample("y", dist.Normal(e, 1).to_event(2), obs=y)

    with pytest.raises(nf.VerticalModelError, match="'y'.*predictor"):
        _trace(nf.augment(model, 1.0))


def test_parties_with_different_row_counts_are_refused():
    model = _two_party(body_b=lambda: nf.contribution("b", jnp.ones(4)))
    with pytest.raises(nf.VerticalModelError, match="different row counts.*5 and 4"):
        _trace(nf.augment(model, 1.0))
    with pytest.raises(ValueError, match="different row counts"):
        nf.VerticalData({"a": {"x": jnp.ones(5)}, "b": {"w": jnp.ones(4)}})


def test_a_party_contributes_once():
    def body():
        nf.contribution("b", jnp.ones(5))
        return nf.contribution("b", jnp.ones(5))

    with pytest.raises(nf.VerticalModelError, match="two contributions"):
        _trace(nf.augment(_two_party(body_b=body), 1.0))


@pytest.mark.parametrize("rho", [0.0, -1.0, float("nan"), float("inf"), "1", True])
def test_rho_must_be_a_positive_standard_deviation(rho):
    with pytest.raises(ValueError, match="rho must be a positive"):
        nf.augment(_two_party(), rho)


def test_other_bad_arguments():
    with pytest.raises(ValueError, match="kind must be"):
        nf.augment(_two_party(), 1.0, kind="axda")
    with pytest.raises(nf.VerticalModelError, match="already augmented"):
        nf.augment(nf.augment(_two_party(), 1.0), 1.0)
    with pytest.raises(nf.VerticalModelError, match="no entry for party 'b'"):
        _trace(nf.augment(_two_party(), {"a": 1.0}))
    with pytest.raises(ValueError, match="party must be a non-empty string"):
        nf.vertical("a/b")
    with pytest.raises(ValueError, match="both 'a' and 'b'"):
        nf.VerticalData({"a": {"x": jnp.ones(2)}, "b": {"x": jnp.ones(2)}})
    with pytest.raises(ValueError, match="labels must be"):
        nf.VerticalData({"a": {"x": jnp.ones(2)}}, labels="clients")

    def no_likelihood(x, y=None):
        with nf.vertical("a"):
            nf.contribution("a", x * numpyro.sample("beta", dist.Normal(0, 1)))

    with pytest.raises(nf.VerticalModelError, match="likelihood .* is missing"):
        _trace(nf.augment(no_likelihood, 1.0))


def test_auxiliary_inherits_the_rows_plate():
    data = fx.gaussian_data()
    aug = nf.augment(fx.gaussian_model(), fx.RHO)
    tr = handlers.trace(handlers.seed(aug, 0)).get_trace(**data.pooled())
    site = tr["a/z"]
    assert [f.name for f in site["cond_indep_stack"]] == ["rows"]
    assert site["fn"].event_shape == () and site["fn"].batch_shape == (40,)
    assert np.allclose(site["fn"].scale, fx.RHO)
