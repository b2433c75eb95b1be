# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The reference points federated VI is judged against (Hassan et al., §4-S3):
independent per-silo VI (no collaboration) and centralized VI on pooled data."""

from typing import Any, Callable, NamedTuple

import jax
from numpyro.infer import SVI, Trace_ELBO
import optax

from numpyro_fed.data import FederatedData
from numpyro_fed.infer.driver import RunResult
from numpyro_fed.infer.vi import SFVI

__all__ = ["IndependentFit", "fit_centralized", "fit_independent"]


class IndependentFit(NamedTuple):
    """One silo's stand-alone fit.

    - **svi** - the one-silo :class:`~numpyro_fed.SFVI` that produced it.
    - **data** - the silo's data as a one-silo :class:`~numpyro_fed.FederatedData`.
    - **result** - its ``RunResult``.
    """

    svi: SFVI
    data: FederatedData
    result: RunResult

    @property
    def params(self):
        return self.result.params

    def sample_posterior(self, rng_key: jax.Array, num_samples: int = 1) -> dict:
        """Draws from this silo's fitted posterior (local sites of its own units)."""
        return self.svi.sample_posterior(
            rng_key, self.result.params, self.data, num_samples=num_samples
        )


def fit_independent(
    model: Callable,
    make_guide: Callable[[Callable], Any],
    optim: optax.GradientTransformation,
    data: FederatedData,
    rng_key: jax.Array,
    num_steps: int,
    **sfvi_kwargs: Any,
) -> list[IndependentFit]:
    """
    Fit the model on each silo's data alone: no information crosses silos. Each silo
    sees a model whose likelihood covers only its own units, so its global posterior
    is the one its data alone support.

    :param callable model: the federated model.
    :param callable make_guide: ``model -> guide``, e.g. ``nf.AutoGlobalLocalNormal``.
    :param optim: optax transformation.
    :param FederatedData data: the silos' data.
    :param jax.random.key rng_key: random key (split per silo).
    :param int num_steps: VI steps per silo.
    :return: one :class:`IndependentFit` per silo.

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp, optax
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
        ...     with numpyro.plate("data", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
        >>> fed = nf.federate(model, silos="data")
        >>> data = nf.FederatedData.from_groups([0, 0, 1, 1], y=jnp.array([1.0, 1, 4, 4]))
        >>> fits = nf.baselines.fit_independent(fed, nf.AutoGlobalLocalNormal, optax.adam(0.05), data,
        ...                           jax.random.key(0), 1500)
        >>> [round(float(f.params.eta_global["loc"][0]), 1) for f in fits]
        [1.0, 4.0]
    """
    results = []
    for j, key in enumerate(jax.random.split(rng_key, data.num_silos)):
        own = FederatedData.from_silos([data.silo(j)])
        svi = SFVI(model, make_guide(model), optim, **sfvi_kwargs)
        results.append(
            IndependentFit(svi, own, svi.run(key, num_steps, own, progress_bar=False))
        )
    return results


def fit_centralized(
    model: Callable,
    guide: Any,
    optim: optax.GradientTransformation,
    data: FederatedData,
    rng_key: jax.Array,
    num_steps: int,
    *,
    progress_bar: bool = False,
    **svi_kwargs: Any,
):
    """
    Centralized VI on the pooled data with NumPyro's own ``SVI`` and ``Trace_ELBO``:
    the reference that SFVI equals when all data could be pooled.

    :return: NumPyro's ``SVIRunResult`` (params under the guide's NumPyro names).
    """
    svi = SVI(model, guide, optim, Trace_ELBO(**svi_kwargs))
    return svi.run(rng_key, num_steps, progress_bar=progress_bar, **data.pooled())
