# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""``FedGVI``: the NumPyro-style class over :func:`~numpyro_fed.algorithms.fedgvi.fedgvi`,
PVI's machinery (:class:`~numpyro_fed.PVI`) with a robust loss and a divergence."""

from typing import Any, Callable

import optax

from numpyro_fed.algorithms.fedgvi import (
    beta_divergence_loss,
    fedgvi,
    gce_loss,
    renyi_divergence,
)
from numpyro_fed.checks import check_count
from numpyro_fed.expfam import kl
from numpyro_fed.infer.pvi import PVI

__all__ = ["FedGVI"]


class FedGVI(PVI):
    """
    Federated generalized VI with a variational cavity (Patel, 2024) on the PVI
    machinery (:func:`~numpyro_fed.algorithms.fedgvi.fedgvi`): the same schedules,
    damping, validity checks and local latents, with

    - a robust loss in place of each observation's log-likelihood (``loss``),
    - a divergence :math:`D` to the prior (``divergence``) for the server's posterior
      and for each silo's cavity, which the silo computes from the aggregated
      :math:`\\sum_k \\eta_k` minus its own factor: the server never sends another
      silo's factor.

    With ``loss="nll"`` and ``divergence="kl"`` the run is PVI's.

    :param callable model: a federated model.
    :param guide: as for :class:`~numpyro_fed.PVI`.
    :param local_optim: each silo's optax optimizer.
    :param loss: ``"nll"``, ``("gce", gamma)`` (generalized cross-entropy),
        ``("beta", beta)`` (density power), or a callable ``(site, log_prob) ->
        value`` applied to each observation's log-likelihood.
    :param divergence: ``"kl"`` or ``("renyi", alpha)`` with ``alpha`` in (0, 1).
    :param int cavity_steps: Newton iterations for a non-KL variational cavity.
    :param kwargs: the remaining :class:`~numpyro_fed.PVI` options.

    **References:**

    1. *Variational cavity for federated generalized variational inference*,
       Patel (2024).

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp, optax
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(x, y=None):
        ...     w = numpyro.sample("w", dist.Normal(0.0, 1.0))
        ...     with numpyro.plate("data", x.shape[0]):
        ...         numpyro.sample("y", dist.Bernoulli(logits=w * x), obs=y)
        >>> fed = nf.federate(model, silos="data")
        >>> x = jnp.linspace(-2, 2, 40)
        >>> data = nf.FederatedData.from_groups(jnp.arange(40) % 4, x=x, y=1.0 * (x > 0))
        >>> gvi = nf.FedGVI(fed, loss=("gce", 0.5), local_steps=20, schedule="sequential")
        >>> result = gvi.run(jax.random.key(0), 1, data, progress_bar=False)
        >>> bool(result.params.eta_global["loc"][0] > 0)
        True
        >>> # A Renyi-alpha divergence in place of KL (variational cavity by Newton):
        >>> renyi = nf.FedGVI(fed, loss=("gce", 0.5), divergence=("renyi", 0.5))
    """

    def __init__(
        self,
        model: Callable,
        guide: Any = None,
        local_optim: optax.GradientTransformation | None = None,
        *,
        loss: Any = "nll",
        divergence: Any = "kl",
        cavity_steps: int = 20,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, guide, local_optim, **kwargs)
        self.loss = _resolve_loss(loss)
        self.divergence = _resolve_divergence(divergence)
        self.cavity_steps = check_count("cavity_steps", cavity_steps)

    def _make_algorithm(self, data: Any):
        return fedgvi(
            **self._options(data),
            loss=self.loss,
            divergence=self.divergence,
            cavity_steps=self.cavity_steps,
        )


def _resolve_loss(loss: Any) -> Callable | None:
    if loss == "nll" or loss is None:
        return None
    if callable(loss):
        return loss
    if isinstance(loss, tuple) and len(loss) == 2:
        kind, value = loss
        if kind == "gce":
            return gce_loss(value)
        if kind == "beta":
            return beta_divergence_loss(value)
    raise ValueError(
        f"loss must be 'nll', ('gce', gamma), ('beta', beta) or a callable; got "
        f"{loss!r}."
    )


def _resolve_divergence(divergence: Any) -> Callable:
    if divergence == "kl":
        return kl
    if isinstance(divergence, tuple) and len(divergence) == 2:
        kind, alpha = divergence
        if kind == "renyi":
            return renyi_divergence(alpha)
    raise ValueError(
        f"divergence must be 'kl' or ('renyi', alpha); got {divergence!r}."
    )
