# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Derive the augmented models of Hassan et al. (seed 003) from the vertical marks.

``augment(model, rho, kind)`` returns an ordinary NumPyro model:

* ``kind="augmented"`` (eq. 6): every :func:`~numpyro_fed.contribution` becomes an
  auxiliary latent site ``"{party}/z"`` :math:`\\sim \\mathcal N(g_j, \\rho)` sampled
  where the contribution is made (so it inherits the user's rows plate, its
  subsample indices and its :math:`n/B` scale), and the model carries on with
  :math:`z_j` in place of :math:`g_j`;
* ``kind="power"`` (eq. 7): the same auxiliaries, and the likelihood sites (observed
  sites outside every party block) are replaced by one factor per party,
  ``"{party}/power_likelihood"`` :math:`= \\frac1J \\log p(y \\mid g_j, z_{-j})`,
  obtained by re-running the model with every latent held fixed and only party
  :math:`j`'s contribution exact. Each factor is tagged with its party, which
  evaluates it (it needs the labels: Algorithm 2).

:math:`\\rho` is a **standard deviation** (the paper uses both readings).
"""

from collections.abc import Mapping
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpyro
from numpyro import handlers
import numpyro.distributions as dist
from numpyro.primitives import _PYRO_STACK, Messenger

from numpyro_fed.densities import site_log_prob
from numpyro_fed.vertical.markers import (
    BLOCK_MSG,
    CONTRIBUTION_MSG,
    party_of,
    vertical,
)

__all__ = ["AugmentedModel", "VerticalModelError", "augment"]

KINDS = ("augmented", "power")


class VerticalModelError(ValueError):
    """A vertically marked model that cannot be augmented (the message says why)."""


def z_name(party: str) -> str:
    """Name of party ``party``'s auxiliary site."""
    return f"{party}/z"


def copy_name(party: str) -> str:
    """Name of party ``party``'s power-likelihood factor."""
    return f"{party}/power_likelihood"


def _is_likelihood(msg: dict) -> bool:
    observed = msg["type"] == "sample" and bool(msg.get("is_observed"))
    return observed and party_of(msg) is None


def _event_dims(value: jax.Array) -> int:
    """Trailing dims of ``value`` that no enclosing plate covers (the user's rows
    plate, if any, gives the batch dims of the auxiliary site)."""
    dims = [-h.dim for h in _PYRO_STACK if isinstance(h, numpyro.plate)]
    ndim = jnp.ndim(value)
    return ndim if not dims else min(min(dims) - 1, ndim)


class _Augment(Messenger):
    """Answers the contribution queries of one run of the model and records what it
    saw. ``mode``: ``"augmented"`` / ``"power_main"`` (sample the auxiliaries),
    ``"probe"`` (return the exact :math:`g_j`: the original model), ``"copy"``
    (exact :math:`g` for ``copy_party``, the main run's :math:`z` for the others)."""

    def __init__(
        self, owner: "AugmentedModel", mode: str, copy_party=None, z_values=None
    ) -> None:
        self.owner = owner
        self.mode = mode
        self.copy_party = copy_party
        self.z_values = z_values or {}
        self.blocks: list[str] = []
        self.contributions: dict[str, jax.Array] = {}
        self.z: dict[str, jax.Array] = {}
        self.likelihood: dict[str, dict] = {}
        super().__init__()

    def __enter__(self) -> "_Augment":
        super().__enter__()
        return self

    def process_message(self, msg: dict) -> None:
        if msg["type"] == BLOCK_MSG:
            if msg["party"] not in self.blocks:
                self.blocks.append(msg["party"])
            msg["stop"] = True
        elif msg["type"] == CONTRIBUTION_MSG:
            msg["handler"] = self
            msg["stop"] = True
        elif self.mode == "power_main" and _is_likelihood(msg):
            # Replaced by the per-party copies: no outer handler may count it.
            msg["stop"] = True

    def postprocess_message(self, msg: dict) -> None:
        if _is_likelihood(msg):
            self.likelihood[msg["name"]] = {
                "batch_shape": tuple(msg["fn"].batch_shape),
                "shape": tuple(msg["fn"].shape()),
                "value_shape": tuple(jnp.shape(msg["value"])),
                "value": msg["value"],
            }

    def contribute(self, party: str, value: Any) -> Any:
        shape = tuple(jnp.shape(value))
        if len(shape) == 0:
            raise VerticalModelError(
                f"Party {party!r}'s contribution is a scalar; it must have one entry "
                "per row (shape (rows,) or (rows, C))."
            )
        if party in self.contributions:
            raise VerticalModelError(
                f"Party {party!r} marks two contributions; a party contributes once "
                "(sum its terms before calling nf.contribution)."
            )
        for other, earlier in self.contributions.items():
            seen = tuple(jnp.shape(earlier))
            if seen[0] != shape[0]:
                raise VerticalModelError(
                    f"Parties {other!r} and {party!r} have different row counts "
                    f"({seen[0]} and {shape[0]}): vertically split data need the same, "
                    "aligned rows at every party."
                )
            if seen != shape:
                raise VerticalModelError(
                    f"Party {party!r}'s contribution has shape {shape} but party "
                    f"{other!r}'s has {seen}: every contribution must have the shape of "
                    "the shared predictor."
                )
        self.contributions[party] = value
        if self.mode == "probe" or (self.mode == "copy" and party == self.copy_party):
            return value
        if self.mode == "copy":
            return self.z_values[party]
        rho = self.owner.rho_of(party)
        z = numpyro.sample(
            z_name(party), dist.Normal(value, rho).to_event(_event_dims(value))
        )
        self.z[party] = z
        return z

    def finish(self) -> None:
        """Checks that need the whole run."""
        if not self.contributions:
            raise VerticalModelError(
                "The model marks no nf.contribution(party, value): there is nothing to "
                "augment. Mark each party's per-row contribution inside its "
                "`with nf.vertical(party):` block."
            )
        missing = [p for p in self.blocks if p not in self.contributions]
        if missing:
            raise VerticalModelError(
                f"Party block(s) {missing} mark no nf.contribution: every "
                "vertical(party) block must mark its per-row contribution."
            )
        if self.mode == "probe":
            return
        if not self.likelihood:
            raise VerticalModelError(
                "The model has no observed site outside the party blocks: the label "
                "holder's likelihood p(y | contributions) is missing."
            )
        shape = tuple(jnp.shape(next(iter(self.contributions.values()))))
        for name, info in self.likelihood.items():
            batch = info["batch_shape"]
            if info["value_shape"] != info["shape"]:
                raise VerticalModelError(
                    f"Likelihood site {name!r}: the observations have shape "
                    f"{info['value_shape']} but the predictor gives {info['shape']}; "
                    f"check the contributions' shape {shape}."
                )
            if batch and batch != shape[: len(batch)]:
                raise VerticalModelError(
                    f"Likelihood site {name!r} has predictor shape {batch}, which "
                    f"differs from the contributions' shape {shape}."
                )


class AugmentedModel:
    """The augmented model of a vertically marked model: an ordinary NumPyro model
    (call it, trace it, run NUTS or SVI on it). Build it with :func:`augment`.

    - **model** - the original, marked model.
    - **rho** - the auxiliary standard deviation (a float, or a dict by party).
    - **kind** - ``"augmented"`` (eq. 6) or ``"power"`` (eq. 7).
    """

    def __init__(self, model: Callable, rho: Any, kind: str) -> None:
        self.model = model
        self.rho = rho
        self.kind = kind

    def rho_of(self, party: str) -> float:
        """:math:`\\rho_j` of ``party``."""
        if isinstance(self.rho, Mapping):
            if party not in self.rho:
                raise VerticalModelError(
                    f"rho has no entry for party {party!r} (it has {sorted(self.rho)})."
                )
            return self.rho[party]
        return self.rho

    def run(self, mode: str, *args: Any, **kwargs: Any) -> tuple[Any, _Augment]:
        """Run the original model under the handler in ``mode`` (``"probe"``: exact
        contributions, no auxiliaries); returns ``(output, handler records)``."""
        with _Augment(self, mode) as handler:
            out = self.model(*args, **kwargs)
        handler.finish()
        return out, handler

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.kind == "augmented":
            return self.run("augmented", *args, **kwargs)[0]
        with handlers.trace() as main:
            out, handler = self.run("power_main", *args, **kwargs)
        values = {
            name: site["value"]
            for name, site in main.items()
            if site["type"] in ("sample", "param", "plate")
        }
        parties = sorted(handler.contributions)
        for party in parties:
            # Hidden from every outer handler: only the factor below is a site.
            with handlers.block(), handlers.trace() as copy:
                with handlers.substitute(data=values):
                    with _Augment(self, "copy", party, handler.z) as h:
                        self.model(*args, **kwargs)
            log_lik = sum(site_log_prob(copy[name]) for name in h.likelihood)
            with vertical(party):
                numpyro.factor(copy_name(party), log_lik / len(parties))
        return out


def augment(model: Callable, rho: Any, kind: str = "augmented") -> AugmentedModel:
    """
    The augmented model of a vertically marked model (Hassan et al., eqs. 6 and 7).

    Each :func:`~numpyro_fed.contribution` becomes an auxiliary latent
    ``"{party}/z"`` :math:`\\sim\\mathcal N(g_j(x_j,\\theta_j), \\rho)` per row; the
    likelihood reads :math:`\\sum_j z_j` (``"augmented"``) or is replaced by the power
    likelihood :math:`\\prod_j p(y\\mid g_j, z_{-j})^{1/J}` (``"power"``). As
    :math:`\\rho\\to0` both tend to the original model; for a Gaussian likelihood the
    augmented model is the original with noise variance :math:`\\sigma^2 + J\\rho^2`.

    :param callable model: a model marked with :class:`~numpyro_fed.vertical` and
        :func:`~numpyro_fed.contribution`.
    :param rho: the auxiliary **standard deviation** :math:`\\rho > 0`, or a dict of
        one per party.
    :param str kind: ``"augmented"`` or ``"power"``.
    :return: an ordinary NumPyro model.
    :rtype: AugmentedModel

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp
        >>> import numpyro, numpyro.distributions as dist
        >>> from numpyro import handlers
        >>> import numpyro_fed as nf
        >>> def model(x1, x2, y=None):
        ...     with nf.vertical("a"):
        ...         b1 = numpyro.sample("b1", dist.Normal(0, 1))
        ...         e1 = nf.contribution("a", x1 * b1)
        ...     with nf.vertical("b"):
        ...         b2 = numpyro.sample("b2", dist.Normal(0, 1))
        ...         e2 = nf.contribution("b", x2 * b2)
        ...     with numpyro.plate("rows", x1.shape[0]):
        ...         numpyro.sample("y", dist.Normal(e1 + e2, 1), obs=y)
        >>> aug = nf.augment(model, rho=0.5)
        >>> tr = handlers.trace(handlers.seed(aug, 0)).get_trace(jnp.ones(4), jnp.ones(4), jnp.ones(4))
        >>> [name for name in tr if tr[name]["type"] == "sample"]
        ['b1', 'a/z', 'b2', 'b/z', 'y']
    """
    if isinstance(model, AugmentedModel):
        raise VerticalModelError("The model is already augmented.")
    if not callable(model):
        raise TypeError(f"model must be callable, got {type(model).__name__}.")
    if kind not in KINDS:
        raise ValueError(f"kind must be 'augmented' or 'power', got {kind!r}.")
    values = rho.values() if isinstance(rho, Mapping) else [rho]
    for r in values:
        if isinstance(r, bool) or not isinstance(r, (int, float)):
            raise ValueError(
                f"rho must be a positive float (a standard deviation), got {r!r}."
            )
        if not (math.isfinite(r) and r > 0):
            raise ValueError(
                f"rho must be a positive, finite standard deviation, got {r!r}."
            )
    return AugmentedModel(model, rho, kind)
