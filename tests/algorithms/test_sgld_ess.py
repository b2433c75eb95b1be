# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""``sgld_diagnostics.warn_low_ess``: a chain too autocorrelated for its means to be
trusted is named, with its effective sample size; independent draws pass silently."""

import warnings

import numpy as np
import pytest

from numpyro_fed.sgld_diagnostics import MIN_ESS, warn_low_ess


def _ar1(rho, shape, seed=0):
    """Stationary unit-variance AR(1) chains, ``(chains, draws)``: ESS about
    ``n (1 - rho) / (1 + rho)``."""
    e = np.random.default_rng(seed).normal(size=shape)
    x = np.empty(shape)
    x[:, 0] = e[:, 0]
    for t in range(1, shape[1]):
        x[:, t] = rho * x[:, t - 1] + np.sqrt(1 - rho**2) * e[:, t]
    return x


def test_warn_low_ess_names_the_autocorrelated_site():
    slow, fast = _ar1(0.99, (2, 2000)), _ar1(0.0, (2, 2000), seed=1)
    with pytest.warns(
        UserWarning, match=r"DSGLD: effective sample size below 400"
    ) as w:
        ess = warn_low_ess({"tau": slow, "mu": fast[..., None]}, name="DSGLD")
    (message,) = [str(x.message) for x in w]
    assert f"tau {ess['tau']:.0f} of 4000 draws" in message and "mu" not in message
    # AR(1) with rho 0.99: ESS ~ 4000 * 0.01 / 1.99 = 20; independent draws ~ 4000.
    assert 8 < ess["tau"] < 50 and ess["mu"] > 3000


def test_warn_low_ess_silent_when_enough_and_honours_sites():
    x = {"mu": _ar1(0.5, (2, 2000)), "tau": _ar1(0.995, (2, 2000))}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ess = warn_low_ess(x, sites=["mu"])  # ESS ~ 4000 / 3 > MIN_ESS
    assert list(ess) == ["mu"] and ess["mu"] > MIN_ESS


def test_warn_low_ess_reads_an_mcmc_and_refuses_flat_draws():
    class Run:  # what it reads of numpyro.infer.MCMC
        def get_samples(self, group_by_chain=False):
            assert group_by_chain
            return {"mu": _ar1(0.999, (1, 1000))}

    with pytest.warns(UserWarning, match="mu"):
        assert warn_low_ess(Run())["mu"] < 20
    with pytest.raises(ValueError, match=r"'mu' shaped \(chains, draws"):
        warn_low_ess({"mu": np.zeros(100)})


def test_reading_short_sgld_chains_warns_and_nuts_chains_do_not():
    """nf.to_arviz and nf.compare read an MCMC's draws: a DSGLD chain of tiny steps
    (ESS far below 400) is named there; a NUTS run of the same model is not checked
    (NumPyro reports its own n_eff)."""
    import jax
    import jax.numpy as jnp
    from numpyro.infer import MCMC, NUTS

    import numpyro_fed as nf
    from tests import _models as m

    fed = nf.federate(m.normal_normal, silos="group")
    y = np.random.default_rng(0).normal(size=(6, 3)) + 1.0
    data = nf.FederatedData.from_groups(np.array([0, 0, 1, 1, 2, 2]), y=y)
    mcmc = MCMC(nf.DSGLD(fed, 1e-5), num_warmup=0, num_samples=300, progress_bar=False)
    mcmc.run(jax.random.key(0), data)
    with pytest.warns(UserWarning, match="DSGLD: effective sample size below 400"):
        nf.to_arviz(mcmc)
    with pytest.warns(UserWarning, match="DSGLD: effective sample size below 400"):
        nf.compare(mcmc, {"mu": np.zeros(1000)}, var_names=["mu"])
    nuts = MCMC(
        NUTS(m.normal_normal), num_warmup=20, num_samples=20, progress_bar=False
    )
    nuts.run(jax.random.key(1), y=jnp.asarray(y))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        nf.to_arviz(nuts)
