# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Per-silo potentials: prior + silo terms equal NumPyro's pooled unconstrained log
density (values and gradients), minibatches are unbiased, batch slots are uniform."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer.util import potential_energy
import pytest

import numpyro_fed as nf
from numpyro_fed.potentials import batch_indices, federated_potential
from tests import _models as m


def constrained_hierarchy(y):
    """Constrained global (tau > 0) and constrained local (b > 0) sites."""
    mu = numpyro.sample("mu", dist.Normal(0.0, 1.0))
    tau = numpyro.sample("tau", dist.HalfNormal(1.0))
    with numpyro.plate("group", y.shape[0], dim=-2):
        b = numpyro.sample("b", dist.LogNormal(mu, tau))
        with numpyro.plate("obs", y.shape[1], dim=-1):
            numpyro.sample("y", dist.Normal(b, 0.7), obs=y)


@pytest.fixture
def setup():
    rng = np.random.default_rng(0)
    y = np.exp(rng.normal(size=(7, 3)))
    fed = nf.federate(constrained_hierarchy, silos="group")
    data = nf.FederatedData.from_groups(m.split_groups(7, 3)[::-1], y=y)  # padded
    pot = federated_potential(fed, data)
    z = pot.init_position(jax.random.key(1), data)
    return y, data, pot, z


def _split_total(pot, data, z):
    z_global, z_local = pot.split(z)
    total = pot.log_prior(z_global)
    for s in range(data.num_silos):
        arrays = {k: v[s] for k, v in data.arrays.items()}
        local = {k: v[s] for k, v in z_local.items()}
        total = total + pot.silo_log_likelihood(z_global, local, arrays, data.mask[s])
    return total


def test_prior_plus_silo_terms_is_numpyros_pooled_potential(setup):
    y, data, pot, z = setup
    pooled = {**pot.split(z)[0], **data.gather_units(pot.split(z)[1])}
    total = jax.jit(jax.value_and_grad(lambda z: _split_total(pot, data, z)))
    numpyro_potential = lambda p: -potential_energy(constrained_hierarchy, (y,), {}, p)
    expected, ref = jax.jit(jax.value_and_grad(numpyro_potential))(pooled)
    value, grad = total(z)
    np.testing.assert_allclose(value, expected, rtol=1e-12)
    # gradients too: with respect to the globals and to every unit's local latent
    np.testing.assert_allclose(grad["tau"], ref["tau"], rtol=1e-10)
    np.testing.assert_allclose(grad["mu"], ref["mu"], rtol=1e-10)
    np.testing.assert_allclose(data.gather_units(grad["b"]), ref["b"], rtol=1e-10)
    # padded units' locals carry no density
    padded = np.asarray(~data.mask)
    assert padded.any() and np.all(np.asarray(grad["b"])[padded] == 0.0)


def test_minibatch_term_is_unbiased_by_enumeration(setup):
    _, data, pot, z = setup
    z_global, z_local = pot.split(z)
    s = 0
    arrays = {k: v[s] for k, v in data.arrays.items()}
    local = {k: v[s] for k, v in z_local.items()}
    n = data.sizes[s]
    full = pot.silo_log_likelihood(z_global, local, arrays, data.mask[s])
    batch = jax.jit(pot.minibatch_log_likelihood)
    pairs = [(i, j) for i in range(n) for j in range(n)]  # with replacement, m = 2
    mean = sum(batch(z_global, local, arrays, jnp.array(p), n) for p in pairs)
    np.testing.assert_allclose(mean / len(pairs), full, rtol=1e-12)


@pytest.mark.parametrize("replace", [True, False], ids=["with", "without"])
def test_batch_indices_are_uniform_over_real_units(replace):
    keys = jax.random.split(jax.random.key(0), 20000)
    idx = np.asarray(jax.vmap(lambda k: batch_indices(k, 5, 8, 3, replace))(keys))
    assert idx.min() >= 0 and idx.max() < 5
    if not replace:
        assert all(len(set(row)) == 3 for row in idx)
    counts = np.bincount(idx.ravel(), minlength=5)
    expected = idx.size / 5  # each real slot equally likely
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected))


def test_init_position_layout_and_local_units_first(setup):
    _, data, pot, z = setup
    assert z["mu"].shape == () and z["tau"].shape == ()
    assert z["b"].shape == (data.num_silos, data.padded_size, 1)
    assert [s.name for s in pot.local_sites] == ["b"] and pot.global_dim == 2
    assert all(np.isfinite(np.asarray(v)).all() for v in z.values())
    np.testing.assert_allclose(
        pot.unflatten(pot.flatten(pot.split(z)[0]))["tau"], z["tau"]
    )


def test_param_sites_are_rejected_by_name():
    data = nf.FederatedData.from_groups(m.split_groups(7, 2), **m.hierarchical_data())
    fed = nf.federate(m.hierarchical, silos="group")
    with pytest.raises(ValueError, match=r"numpyro.param site\(s\) \['s'\]"):
        federated_potential(fed, data)
