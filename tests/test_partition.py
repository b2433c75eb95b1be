# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Roles from one trace, and clear errors for models federated learning cannot take."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
import optax
import pytest

import numpyro_fed as nf
from tests import _models as m


def _data(n=6, silos=2):
    return nf.FederatedData.from_groups(np.arange(n) % silos, y=jnp.linspace(-1, 1, n))


def test_roles_of_hierarchical_model():
    data = nf.FederatedData.from_groups(np.arange(7) % 3, **m.hierarchical_data())
    roles = nf.partition.analyze(nf.federate(m.hierarchical, silos="group"), data)
    assert roles == nf.partition.ModelRoles(
        silo_plate="group",
        silo_dim=-2,
        silo_size=7,
        global_sites=("mu", "tau"),
        local_sites=("b",),
        observed_sites=("y",),
        param_sites=("s",),
    )


def test_roles_of_flat_regression():
    data = nf.FederatedData.from_groups(np.arange(40) % 4, **m.logistic_data())
    roles = nf.partition.analyze(nf.federate(m.logistic, silos="data"), data)
    assert (roles.global_sites, roles.local_sites, roles.silo_dim) == (
        ("beta",),
        (),
        -1,
    )


def test_model_without_silo_plate():
    def model(y):
        mu = numpyro.sample("mu", dist.Normal())
        with numpyro.plate("data", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu), obs=y)

    with pytest.raises(ValueError, match="no silo plate.*'data'"):
        nf.partition.analyze(model, _data())


def test_plate_name_not_found():
    with pytest.raises(ValueError, match="no plate named 'rows'.*'group'"):
        nf.partition.analyze(
            nf.federate(m.hierarchical, silos="rows"),
            nf.FederatedData.from_groups(np.arange(7) % 2, **m.hierarchical_data()),
        )


def test_plate_sized_not_from_data():
    """A hard-coded plate size disagrees with what a silo holds: say so, not a
    shape error deep inside JAX."""

    def model(y):
        mu = numpyro.sample("mu", dist.Normal())
        with nf.silo_plate("school", 6):
            numpyro.sample("y", dist.Normal(mu), obs=y)

    with pytest.raises(ValueError, match="'school' has size 6.*holds 3 units"):
        nf.partition.analyze(model, _data())


def test_global_depends_on_local():
    def model(y):
        with nf.silo_plate("data", y.shape[0]):
            z = numpyro.sample("z", dist.Normal())
            numpyro.sample("y", dist.Normal(z), obs=y)
        numpyro.sample("g", dist.Normal(z.sum()))

    with pytest.raises(ValueError, match="Global site 'g' depends on local site.*'z'"):
        nf.partition.analyze(model, _data())


def test_discrete_latent():
    def model(y):
        k = numpyro.sample("k", dist.Bernoulli(0.5))
        with nf.silo_plate("data", y.shape[0]):
            numpyro.sample("y", dist.Normal(k), obs=y)

    with pytest.raises(ValueError, match="'k' is discrete"):
        nf.partition.analyze(model, _data())


def test_observed_outside_silo_plate():
    def model(y):
        mu = numpyro.sample("mu", dist.Normal())
        numpyro.sample("total", dist.Normal(mu), obs=y.sum())
        with nf.silo_plate("data", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu), obs=y)

    with pytest.raises(ValueError, match="Observed site 'total' lies outside"):
        nf.partition.analyze(model, _data())


def test_federate_needs_a_plate_name():
    with pytest.raises(ValueError, match="silos="):
        nf.federate(m.hierarchical)


def test_state_and_data_silo_counts_must_match():
    fed = nf.federate(m.logistic, silos="data")
    arrays = m.logistic_data()
    three = nf.FederatedData.from_groups(np.arange(40) % 3, **arrays)
    four = nf.FederatedData.from_groups(np.arange(40) % 4, **arrays)
    svi = nf.SFVI(fed, nf.AutoGlobalLocalNormal(fed), optax.adam(0.1))
    state = svi.init(jax_key(), three)
    with pytest.raises(ValueError, match="3 silos but the data hold 4"):
        svi.update(state, four)


def jax_key():
    import jax

    return jax.random.key(0)


def test_federated_model_is_still_an_ordinary_model():
    """NUTS-facing behaviour: the federated model's log density equals the original."""
    from numpyro.infer.util import log_density

    arrays = m.hierarchical_data()
    params = {
        "mu": jnp.array([0.3, -0.2]),
        "tau": jnp.array(0.7),
        "s": jnp.array(0.9),
        "b": jnp.ones((7, 1, 2)),
    }
    a, _ = log_density(m.hierarchical, (), arrays, params)
    b, _ = log_density(nf.federate(m.hierarchical, silos="group"), (), arrays, params)
    np.testing.assert_array_equal(a, b)


def test_param_without_constraint_is_real():
    """A numpyro.param with no constraint argument is unconstrained (NumPyro's
    default), not an error."""

    def model(y):
        shift = numpyro.param("shift", 0.5)
        mu = numpyro.sample("mu", dist.Normal(shift, 1.0))
        with numpyro.plate("data", y.shape[0]):
            numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)

    fed = nf.federate(model, silos="data")
    data = nf.FederatedData.from_groups(jnp.arange(4) % 2, y=jnp.ones(4))
    guide = nf.AutoMeanField(fed)
    guide.setup(data)
    assert guide.theta_constraints()["shift"] is dist.constraints.real
    svi = nf.SFVI(fed, guide, optax.adam(0.1))
    result = svi.run(jax.random.PRNGKey(0), 3, data, progress_bar=False)
    assert "shift" in result.params.theta
