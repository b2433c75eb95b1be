# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The owners' single-sample ELBO terms of an augmented model, on each owner's own
view of the data: what vertical SFVI's messages are about."""

from typing import Any, Callable, NamedTuple

import jax
from jax import lax
import jax.numpy as jnp
from numpyro import handlers

from numpyro_fed.vertical.augment import AugmentedModel, z_name
from numpyro_fed.vertical.families import VerticalFamily
from numpyro_fed.vertical.structure import (
    SERVER,
    VerticalStructure,
    fill_values,
    owner_log_density,
)

__all__ = ["VerticalTerms", "standard_noise", "vertical_terms"]


def _sg(tree: Any) -> Any:
    return lax.stop_gradient(tree)


def standard_noise(family: VerticalFamily, structure: VerticalStructure) -> Callable:
    """
    The default reparameterization noise of a round: ``(owner, key) -> (eps, tau)``,
    standard normals for :math:`q(\\theta)` (shape ``(dim,)``) and, for a party, for
    its auxiliary (shape ``z_shape``, one entry per row *position*: permuting the
    rows does not permute it). A custom ``noise`` for
    :func:`~numpyro_fed.algorithms.vertical_sfvi.vertical_sfvi` can wrap
    it.

    :param VerticalFamily family: set up on ``structure``.
    :param VerticalStructure structure: the model's structure.
    """

    def noise(owner, key):
        k1, k2 = jax.random.split(key)
        eps = jax.random.normal(k1, (family.dim(owner),))
        if owner == SERVER:
            return eps, None
        return eps, jax.random.normal(k2, structure.z_shape[owner])

    return noise


class VerticalTerms(NamedTuple):
    """The owners' single-sample ELBO terms (``party`` is a static name).

    - **party_draw** - ``(party, raw, view, key, idx) -> (z, values, log_q)``.
    - **party_elbo** - ``(party, raw, view, key, idx, extra) -> (z, elbo)``, other
      owners' values from ``extra`` (placeholders for the rest).
    - **server_values** - ``(raw, key) -> (values, log_q)``: the server's draw.
    - **server_term** - ``(raw, zs, key, idx, linear) -> (objective, elbo)``.
    - **contribution** - ``(party, raw, view) -> u``: the party's full-data
      contribution at the mean of :math:`q(\\theta_j)`.
    """

    party_draw: Callable
    party_elbo: Callable
    server_values: Callable
    server_term: Callable
    contribution: Callable


def vertical_terms(
    model: AugmentedModel,
    family: VerticalFamily,
    structure: VerticalStructure,
    server_view: dict,
    *,
    stl: bool = True,
    noise: Callable | None = None,
) -> VerticalTerms:
    """The owners' ELBO terms that
    :func:`~numpyro_fed.algorithms.vertical_sfvi.vertical_sfvi` exchanges messages
    about (arguments as there)."""
    rows = structure.rows
    subsampled = rows is not None and rows[2] < rows[1]
    noise = noise or standard_noise(family, structure)

    def rows_values(idx):
        return {rows[0]: idx} if subsampled else {}

    def run(values, view):
        seeded = handlers.seed(
            handlers.substitute(model.run, data=fill_values(structure, values)),
            jax.random.key(0),
        )
        return seeded("probe", **view)[1]

    def probe(party, values, view):
        h = run(values, view)
        y = None
        if family.aux == "amortized" and model.kind == "power":
            if len(h.likelihood) != 1:
                raise NotImplementedError(
                    "The amortized power-likelihood family feeds y to its network and "
                    "needs exactly one likelihood site; got "
                    f"{sorted(h.likelihood)}."
                )
            y = next(iter(h.likelihood.values()))["value"]
        return h.contributions[party], y

    def party_draw(party, raw, view, key, idx):
        p = family.constrain(party, raw)
        p_q = _sg(p) if stl else p
        eps, tau = noise(party, key)
        values, log_q = family.draw_latents(party, p, p_q, eps)
        values = {**values, **p["param"], **rows_values(idx)}
        u, y = probe(party, values, view)
        z_loc = family.z_dist(party, p, u, y, idx)
        z = z_loc.loc + z_loc.scale * tau
        log_q_z = family.z_dist(party, p_q, u, y, idx).log_prob(z).sum()
        values[z_name(party)] = z
        return z, values, log_q + structure.z_scale * log_q_z

    def party_elbo(party, raw, view, key, idx, extra):
        z, values, log_q = party_draw(party, raw, view, key, idx)
        values = fill_values(structure, {**extra, **values})
        return z, owner_log_density(model, party, values, view) - log_q

    def server_values(raw, key):
        p = family.constrain(SERVER, raw)
        p_q = _sg(p) if stl else p
        eps, _ = noise(SERVER, key)
        values, log_q = family.draw_latents(SERVER, p, p_q, eps)
        return {**values, **p["param"]}, log_q

    def server_term(raw, zs, key, idx, linear=None):
        values, log_q = server_values(raw, key)
        full = {**values, **{z_name(k): v for k, v in zs.items()}, **rows_values(idx)}
        elbo = owner_log_density(
            model, SERVER, fill_values(structure, full), server_view
        )
        elbo = elbo - log_q
        if linear is not None:  # Algorithm 2: the copies' gradients w.r.t. gamma
            surrogate = sum(
                jnp.sum(linear[k] * values[k]) for k in linear if k in values
            )
            return elbo + surrogate - _sg(surrogate), elbo
        return elbo, elbo

    def contribution(party, raw, view):
        p = family.constrain(party, raw)
        values = {}
        if "loc" in p:
            values, _ = family.unpack(party, p["loc"])
        values.update(p["param"])
        if subsampled:  # the full-data contribution: every row
            values[rows[0]] = jnp.arange(rows[1])
        return run(values, view).contributions[party]

    return VerticalTerms(
        party_draw, party_elbo, server_values, server_term, contribution
    )
