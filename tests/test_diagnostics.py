# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer import MCMC, NUTS
import pytest
import xarray

import numpyro_fed as nf


def _draws(seed=0, num_draws=400):
    rng = np.random.default_rng(seed)
    return {
        "mu": rng.normal(1.0, 2.0, size=num_draws),
        "b": rng.normal(size=(num_draws, 2, 3)) * np.arange(1, 7).reshape(2, 3),
        "_internal": np.zeros(num_draws),
    }


@pytest.fixture(scope="module")
def mcmc():
    def model(y):
        mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    mcmc = MCMC(NUTS(model), num_warmup=50, num_samples=50, progress_bar=False)
    mcmc.run(jax.random.key(0), y=jnp.array([1.0, 2.0, 3.0]))
    return mcmc


# ---------------------------------------------------------------- to_arviz


def test_to_arviz_dict_one_chain():
    draws = _draws()
    idata = nf.to_arviz(draws)
    assert isinstance(idata, xarray.DataTree)
    post = idata.posterior
    assert post.sizes["chain"] == 1 and post.sizes["draw"] == 400
    assert set(post.data_vars) == {"mu", "b"}  # "_internal" is skipped
    assert post["b"].dims[:2] == ("chain", "draw")
    assert post["b"].shape == (1, 400, 2, 3)
    np.testing.assert_array_equal(post["b"].values[0], draws["b"])


def test_to_arviz_dict_num_chains():
    draws = _draws()
    post = nf.to_arviz(draws, num_chains=4).posterior
    assert dict(post.sizes)["chain"] == 4 and dict(post.sizes)["draw"] == 100
    assert post["mu"].shape == (4, 100) and post["b"].shape == (4, 100, 2, 3)
    # Chain by chain, as MCMC.get_samples() concatenates them.
    np.testing.assert_array_equal(post["mu"].values[2], draws["mu"][200:300])
    np.testing.assert_array_equal(post["b"].values[3], draws["b"][300:])


def test_to_arviz_dims_coords():
    idata = nf.to_arviz(
        _draws(), dims={"b": ["row", "col"]}, coords={"row": ["p", "q"]}
    )
    assert idata.posterior["b"].dims == ("chain", "draw", "row", "col")
    assert list(idata.posterior["row"].values) == ["p", "q"]


def test_to_arviz_num_chains_error():
    with pytest.raises(ValueError, match=r"'mu'.*num_chains=3"):
        nf.to_arviz({"mu": np.zeros(10)}, num_chains=3)
    with pytest.raises(ValueError, match="positive integer"):
        nf.to_arviz({"mu": np.zeros(10)}, num_chains=0)


def test_to_arviz_bad_sites():
    with pytest.raises(ValueError, match="'sigma'.*no draw axis"):
        nf.to_arviz({"mu": np.zeros(10), "sigma": 1.0})
    with pytest.raises(ValueError, match="'sigma' has 9 draws"):
        nf.to_arviz({"mu": np.zeros(10), "sigma": np.ones(9)})
    with pytest.raises(TypeError, match="ndarray"):
        nf.to_arviz(np.zeros(10))
    with pytest.raises(TypeError, match="DataTree"):
        nf.to_arviz(nf.to_arviz({"mu": np.zeros(10)}).posterior.to_dataset())


def test_to_arviz_mcmc(mcmc):
    idata = nf.to_arviz(mcmc)
    assert isinstance(idata, xarray.DataTree)
    assert dict(idata.posterior.sizes) == {"chain": 1, "draw": 50}
    np.testing.assert_array_equal(
        idata.posterior["mu"].values[0], np.asarray(mcmc.get_samples()["mu"])
    )
    # The MCMC and DataTree paths of compare read the same draws.
    table = nf.compare(mcmc, idata)
    assert table.loc["mu", "w2"] == 0.0 and table.loc["mu", "mean_diff_sd"] == 0.0


def test_to_arviz_datatree_passthrough():
    idata = nf.to_arviz(_draws())
    assert nf.to_arviz(idata) is idata
    with pytest.raises(ValueError, match="DataTree"):
        nf.to_arviz(idata, num_chains=2)


# ---------------------------------------------------------------- compare


def test_compare_identical():
    draws = _draws()
    table = nf.compare(draws, draws)
    assert list(table.columns) == [
        "mean_fed",
        "mean_reference",
        "sd_fed",
        "sd_reference",
        "mean_diff_sd",
        "sd_ratio",
        "w2",
    ]
    assert len(table) == 1 + 6
    np.testing.assert_array_equal(table["mean_diff_sd"], 0.0)
    np.testing.assert_array_equal(table["w2"], 0.0)
    np.testing.assert_array_equal(table["sd_ratio"], 1.0)
    assert table.attrs == {"max_abs_mean_diff_sd": 0.0, "max_w2": 0.0}


def test_compare_shifted():
    draws = _draws()
    shifted = {k: v + 0.5 for k, v in draws.items()}
    table = nf.compare(shifted, draws, labels=("sfvi", "nuts"))
    sd = np.std(draws["mu"], ddof=1)
    assert table.loc["mu", "sd_nuts"] == pytest.approx(sd, rel=1e-12)
    assert table.loc["mu", "mean_sfvi"] == pytest.approx(draws["mu"].mean() + 0.5)
    assert table.loc["mu", "mean_diff_sd"] == pytest.approx(0.5 / sd, rel=1e-12)
    np.testing.assert_allclose(table["w2"], 0.5, rtol=0, atol=1e-12)
    np.testing.assert_allclose(table["sd_ratio"], 1.0, rtol=1e-12)
    assert table.attrs["max_w2"] == pytest.approx(0.5, abs=1e-12)
    sd_b = np.std(draws["b"][:, 0, 0], ddof=1)
    assert table.attrs["max_abs_mean_diff_sd"] == pytest.approx(0.5 / sd_b, rel=1e-12)


def test_compare_w2_unequal_draw_counts():
    # Quantile functions: {0 on [0,1/2), 1 on [1/2,1)} vs {0, 1, 2 on thirds}; the
    # squared gap is 1 on [1/3,1/2) and on [2/3,1): W2^2 = 1/6 + 1/3.
    table = nf.compare({"x": np.array([1.0, 0.0])}, {"x": np.array([2.0, 0.0, 1.0])})
    assert table.loc["x", "w2"] == pytest.approx(np.sqrt(0.5), rel=1e-12)
    # Repeating every draw leaves the empirical measure, hence W2, unchanged.
    rng = np.random.default_rng(1)
    a, b = rng.normal(size=30), rng.gamma(2.0, size=20)
    w2 = nf.compare({"x": a}, {"x": b}).loc["x", "w2"]
    w2_rep = nf.compare({"x": np.repeat(a, 2)}, {"x": np.tile(b, 3)}).loc["x", "w2"]
    assert w2_rep == pytest.approx(w2, rel=1e-12)
    # Equal counts: the mean squared gap of the sorted draws.
    assert w2 > 0 and nf.compare({"x": a[:20]}, {"x": b}).loc["x", "w2"] == (
        pytest.approx(np.sqrt(np.mean((np.sort(a[:20]) - np.sort(b)) ** 2)), rel=1e-12)
    )


def test_compare_normal_reference():
    draws = _draws()
    table = nf.compare(draws, {"mu": dist.Normal(0.8, 1.5)})
    m, s = draws["mu"].mean(), draws["mu"].std(ddof=1)
    row = table.loc["mu"]
    assert list(table.index) == ["mu"]
    assert row["mean_reference"] == 0.8 and row["sd_reference"] == 1.5
    assert row["mean_diff_sd"] == pytest.approx((m - 0.8) / 1.5, rel=1e-12)
    assert row["sd_ratio"] == pytest.approx(s / 1.5, rel=1e-12)
    assert row["w2"] == pytest.approx(
        np.sqrt((m - 0.8) ** 2 + (s - 1.5) ** 2), rel=1e-12
    )


def test_compare_mvn_reference_and_shape_check():
    rng = np.random.default_rng(2)
    cov = np.array([[4.0, 0.5], [0.5, 0.25]])
    loc = np.array([1.0, -2.0])
    draws = {"beta": rng.multivariate_normal(loc, cov, size=500)}
    table = nf.compare(draws, {"beta": dist.MultivariateNormal(loc, cov)})
    assert list(table.index) == ["beta[0]", "beta[1]"]
    np.testing.assert_allclose(table["sd_reference"], [2.0, 0.5], rtol=1e-12)
    np.testing.assert_allclose(table["mean_reference"], loc, rtol=1e-12)
    m, s = draws["beta"].mean(0), draws["beta"].std(0, ddof=1)
    np.testing.assert_allclose(
        table["w2"], np.hypot(m - loc, s - [2.0, 0.5]), rtol=1e-12
    )
    with pytest.raises(ValueError, match=r"'beta'.*shape \(\)"):
        nf.compare(draws, {"beta": dist.Normal(0.0, 1.0)})


def test_compare_multidim_labels():
    draws = _draws()
    other = _draws(seed=5)
    table = nf.compare(draws, other, var_names=["b"])
    assert list(table.index) == [f"b[{i},{j}]" for i in range(2) for j in range(3)]
    b01 = table.loc["b[0,1]"]
    assert b01["mean_fed"] == pytest.approx(draws["b"][:, 0, 1].mean(), rel=1e-12)
    assert b01["sd_reference"] == pytest.approx(
        other["b"][:, 0, 1].std(ddof=1), rel=1e-12
    )


def test_compare_pools_chains():
    draws = _draws()
    table = nf.compare(nf.to_arviz(draws, num_chains=4), draws)
    np.testing.assert_array_equal(table["w2"], 0.0)
    assert table.loc["mu", "mean_fed"] == pytest.approx(draws["mu"].mean(), rel=1e-12)
    assert table.loc["mu", "sd_fed"] == pytest.approx(
        draws["mu"].std(ddof=1), rel=1e-12
    )


def test_compare_var_names_and_errors():
    draws = _draws()
    assert list(nf.compare(draws, draws, var_names=["mu"]).index) == ["mu"]
    assert list(nf.compare(draws, {"mu": draws["mu"]}).index) == ["mu"]
    with pytest.raises(ValueError, match=r"\['omega'\]"):
        nf.compare(draws, draws, var_names=["mu", "omega"])
    with pytest.raises(ValueError, match="share no site"):
        nf.compare({"mu": draws["mu"]}, {"tau": draws["mu"]})
    with pytest.raises(ValueError, match="'mu' has shape"):
        nf.compare({"mu": draws["mu"]}, {"mu": draws["b"]})
    with pytest.raises(TypeError, match="fed"):
        nf.compare({"mu": dist.Normal(0.0, 1.0)}, draws)


def test_format_compare():
    draws = _draws()
    text = nf.format_compare(nf.compare(draws, {"mu": dist.Normal(1.0, 2.0)}), digits=2)
    lines = text.splitlines()
    assert lines[0].split() == [
        "mean_fed",
        "mean_reference",
        "sd_fed",
        "sd_reference",
        "mean_diff_sd",
        "sd_ratio",
        "w2",
    ]
    assert lines[1].split()[0] == "mu"
    assert lines[1].split()[1] == f"{round(draws['mu'].mean(), 2)}"


def _correlated(rho, n, seed):
    z = np.random.default_rng(seed).normal(size=(n, 2))
    return {"a": z[:, 0], "b": rho * z[:, 0] + np.sqrt(1 - rho**2) * z[:, 1]}


def test_compare_joint_sinkhorn_zero_shift_and_correlation():
    pytest.importorskip("ott")
    draws = _correlated(0.9, 1000, 0)
    same = nf.compare(draws, draws, joint=True)
    assert abs(same.attrs["sinkhorn_divergence"]) < 1e-4
    # A shift of one reference sd in one coordinate: about 1 (the squared W2).
    shifted = {"a": draws["a"] + draws["a"].std(ddof=1), "b": draws["b"]}
    one = nf.compare(shifted, draws, joint=True).attrs["sinkhorn_divergence"]
    assert one == pytest.approx(1.0, abs=0.05)
    two = {"a": draws["a"] + 2 * draws["a"].std(ddof=1), "b": draws["b"]}
    assert nf.compare(two, draws, joint=True).attrs["sinkhorn_divergence"] > 3.5
    # The sign of the correlation flipped: every marginal agrees, the joint does not.
    flipped = {"a": draws["a"], "b": -draws["b"]}
    table = nf.compare(flipped, draws, joint=True)
    assert table.attrs["max_w2"] < 0.1
    assert table.attrs["sinkhorn_divergence"] > 1.0
    assert "sinkhorn_divergence" not in nf.compare(flipped, draws).attrs


def test_compare_joint_needs_draws_on_both_sides():
    draws = {"mu": np.random.default_rng(0).normal(size=100)}
    with pytest.raises(ValueError, match="site 'mu' on both sides"):
        nf.compare(draws, {"mu": dist.Normal(0.0, 1.0)}, joint=True)
