# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Models, guides and plates that federated inference cannot take: each is refused
with an error that names the site, plate or argument (issue 19)."""

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.infer.autoguide import AutoNormal
import optax
import pytest

import numpyro_fed as nf

Y = jnp.array([0.3, 1.2, -0.4, 2.0, 0.9, 1.5, 0.1])


def per_unit_outside(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    # One offset per unit, written outside the silo plate: a local latent in disguise.
    w = numpyro.sample("w", dist.Normal(0.0, 1.0).expand([y.shape[0]]).to_event(1))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu + w, 1.0), obs=y)


def normal_mean(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y)


def normal_mean_and_scale(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    s = numpyro.sample("s", dist.HalfNormal(1.0))
    with numpyro.plate("data", y.shape[0]):
        numpyro.sample("y", dist.Normal(mu, s), obs=y)


def subsampled(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("data", y.shape[0], subsample_size=2) as idx:
        numpyro.sample("y", dist.Normal(mu, 1.0), obs=y[idx])


@pytest.mark.parametrize(
    "groups",
    [[0, 0, 1, 1, 2, 2, 3], [0, 0, 0, 0, 1, 1, 2]],
    ids=["near-equal", "ragged"],
)
def test_per_unit_latent_outside_silo_plate_is_named(groups):
    """A latent sized by the number of units but written outside the silo plate is
    not global: its shape would follow each silo's size."""
    fed = nf.federate(per_unit_outside, silos="data")
    data = nf.FederatedData.from_groups(groups, y=Y)
    svi = nf.SFVI(fed, nf.AutoGlobalLocalNormal(fed), optax.adam(0.05))
    with pytest.raises(ValueError, match=r"'w'.*outside the silo plate 'data'"):
        svi.init(jax.random.key(0), data)


def test_guide_built_for_another_model_is_named():
    data = nf.FederatedData.from_groups([0, 0, 1, 1, 2, 2, 2], y=Y)
    fed = nf.federate(normal_mean_and_scale, silos="data")
    other = nf.federate(normal_mean, silos="data")
    svi = nf.SFVI(fed, nf.AutoGlobalLocalNormal(other), optax.adam(0.05))
    with pytest.raises(ValueError, match=r"guide.*another model.*'s'"):
        svi.init(jax.random.key(0), data)


def test_guide_of_an_equivalent_model_is_accepted():
    """The same model wrapped twice is the same model: its guide works."""
    data = nf.FederatedData.from_groups([0, 0, 1, 1, 2, 2, 2], y=Y)
    fed = nf.federate(normal_mean, silos="data")
    twin = nf.federate(normal_mean, silos="data")
    svi = nf.SFVI(fed, nf.AutoGlobalLocalNormal(twin), optax.adam(0.05))
    result = svi.run(jax.random.key(0), 3, data, progress_bar=False)
    assert np.isfinite(np.asarray(result.losses)).all()


@pytest.mark.parametrize("algorithm", ["SFVI", "SFVIAvg"])
def test_plain_numpyro_autoguide_is_refused(algorithm):
    fed = nf.federate(normal_mean, silos="data")
    kwargs = {"local_steps": 2} if algorithm == "SFVIAvg" else {}
    with pytest.raises(
        TypeError, match=r"guide.*AutoNormal.*nf\.AutoGlobalLocalNormal"
    ):
        getattr(nf, algorithm)(fed, AutoNormal(fed), optax.adam(0.05), **kwargs)


def test_subsample_size_on_silo_plate_is_named():
    fed = nf.federate(subsampled, silos="data")
    data = nf.FederatedData.from_groups([0, 0, 1, 1, 2, 2, 2], y=Y)
    with pytest.raises(ValueError, match=r"silo plate 'data' has subsample_size=2"):
        nf.SFVI(fed, nf.AutoGlobalLocalNormal(fed), optax.adam(0.05)).init(
            jax.random.key(0), data
        )


def ragged_event(y):
    mu = numpyro.sample("mu", dist.Normal(0.0, 10.0))
    with numpyro.plate("county", y.shape[0]):
        # The ragged axis is an event axis, not a plate: its padding has no mask.
        numpyro.sample(
            "y", dist.Normal(mu, 1.0).expand([y.shape[1]]).to_event(1), obs=y
        )


RAGGED = [{"y": np.ones((1, 3))}, {"y": np.ones((1, 5))}]


def test_ragged_axis_that_is_not_a_nested_plate_is_named():
    fed = nf.federate(ragged_event, silos="county")
    data = nf.FederatedData.from_silos(RAGGED)
    svi = nf.SFVI(fed, nf.AutoGlobalLocalNormal(fed), optax.adam(0.05))
    with pytest.raises(ValueError, match=r"Site 'y'.*silo 0.*not a\s+plate nested"):
        svi.init(jax.random.key(0), data)
