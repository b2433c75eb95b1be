# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Trace an augmented model once and split it by owner: each party's latents,
auxiliary and parameters, the server's latents and parameters; then evaluate each
owner's log-density term on the owner's own view of the data."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers
from numpyro.distributions import biject_to, constraints

from numpyro_fed.vertical.augment import (
    AugmentedModel,
    VerticalModelError,
    site_log_prob,
    z_name,
)
from numpyro_fed.vertical.markers import party_of

__all__ = [
    "LatentSpec",
    "VerticalStructure",
    "fill_values",
    "owner_log_density",
    "owners",
    "vertical_structure",
]

SERVER = "server"


class LatentSpec(NamedTuple):
    """- **shape** - the site's constrained shape.
    - **unconstrained_shape** - its shape in the unconstrained space.
    - **support** - the support constraint (``biject_to(support)`` unconstrains).
    """

    shape: tuple
    unconstrained_shape: tuple
    support: Any


class ParamSpec(NamedTuple):
    """- **init** - the ``numpyro.param`` site's initial (constrained) value.
    - **constraint** - its constraint."""

    init: jax.Array
    constraint: Any


class VerticalStructure(NamedTuple):
    """What each owner holds in an augmented model (from one trace).

    - **kind** - ``"augmented"`` or ``"power"``.
    - **parties** - the party names, sorted.
    - **latents** - owner (party or ``"server"``) -> site -> :class:`LatentSpec`:
      the parties' :math:`\\theta_j` and the server's :math:`\\gamma` (auxiliaries
      excluded).
    - **params** - owner -> ``numpyro.param`` site -> :class:`ParamSpec`.
    - **z_shape** - party -> shape of its auxiliary (one entry per row in the batch).
    - **z_event_dim** - party -> event dims of its auxiliary site (dims no plate
      covers).
    - **z_scale** - the auxiliaries' subsampling scale :math:`n/B` (1 without).
    - **rows** - ``(plate name, size, subsample size)`` of the plate around the
      auxiliaries, or ``None``.
    - **likelihood** - names of the likelihood sites (observed, no party).
    """

    kind: str
    parties: tuple
    latents: dict
    params: dict
    z_shape: dict
    z_event_dim: dict
    z_scale: float
    rows: tuple | None
    likelihood: tuple


def owners(trace: dict) -> dict[str, str]:
    """Site name -> owner (a party, or ``"server"``) of every sample/param site."""
    return {
        name: party_of(site) or SERVER
        for name, site in trace.items()
        if site["type"] in ("sample", "param")
    }


def vertical_structure(model: AugmentedModel, arrays: dict) -> VerticalStructure:
    """Trace ``model`` once on ``arrays`` (keyword arguments) and split its sites.

    :param AugmentedModel model: from :func:`~numpyro_fed.augment`.
    :param dict arrays: the model's keyword arguments (e.g. ``data.pooled()``).
    :rtype: VerticalStructure
    """
    if not isinstance(model, AugmentedModel):
        raise TypeError(
            "Expected an augmented model (nf.augment(model, rho, kind)), got "
            f"{type(model).__name__}."
        )
    tr = handlers.trace(handlers.seed(model, jax.random.key(0))).get_trace(**arrays)
    _, probe = handlers.seed(model.run, jax.random.key(0))("probe", **arrays)
    parties = tuple(sorted(probe.contributions))
    latents: dict = {p: {} for p in parties + (SERVER,)}
    params: dict = {p: {} for p in parties + (SERVER,)}
    z_shape, z_event_dim, z_scale, rows = {}, {}, 1.0, None
    aux = {z_name(p) for p in parties}
    for name, site in tr.items():
        owner = party_of(site) or SERVER
        if owner not in latents:
            raise VerticalModelError(
                f"Site {name!r} belongs to party {owner!r}, whose block marks no "
                "contribution."
            )
        if site["type"] == "param":
            constraint = site["kwargs"].get("constraint", constraints.real)
            params[owner][name] = ParamSpec(jnp.asarray(site["value"]), constraint)
        elif site["type"] != "sample" or site["is_observed"]:
            continue
        elif name in aux:
            z_shape[owner] = tuple(jnp.shape(site["value"]))
            z_event_dim[owner] = site["fn"].event_dim
            z_scale = 1.0 if site["scale"] is None else float(site["scale"])
            frames = site["cond_indep_stack"]
            if frames:
                frame = max(frames, key=lambda f: f.dim)  # the rightmost: the rows
                plate = tr[frame.name]
                size, sub = plate["args"]
                rows = (frame.name, size, size if sub is None else sub)
        else:
            if site["fn"].is_discrete:
                raise NotImplementedError(
                    f"Discrete latent site {name!r}: vertical VI needs continuous "
                    "latents (enumerate or marginalize it out)."
                )
            if site["cond_indep_stack"] and owner != SERVER:
                raise VerticalModelError(
                    f"Latent site {name!r} of party {owner!r} is inside the plate "
                    f"{site['cond_indep_stack'][0].name!r}: a party's coefficients are "
                    "sampled outside the rows plate (only its contribution is per row)."
                )
            support = site["fn"].support
            shape = tuple(jnp.shape(site["value"]))
            unc = jax.eval_shape(biject_to(support).inv, site["value"]).shape
            latents[owner][name] = LatentSpec(shape, tuple(unc), support)
    if model.kind == "power" and latents[SERVER]:
        pass  # the server broadcasts its draw in Algorithm 2
    return VerticalStructure(
        model.kind,
        parties,
        latents,
        params,
        z_shape,
        z_event_dim,
        z_scale,
        rows,
        tuple(sorted(probe.likelihood)),
    )


def fill_values(structure: VerticalStructure, values: dict) -> dict:
    """``values`` completed with a fixed placeholder for every latent, auxiliary and
    parameter the caller does not hold (the image of 0 in the unconstrained space,
    and the parameters' initial values): placeholders never reach an owner's term."""
    out = {}
    for owner_sites in structure.latents.values():
        for name, spec in owner_sites.items():
            out[name] = biject_to(spec.support)(jnp.zeros(spec.unconstrained_shape))
    for owner_params in structure.params.values():
        for name, spec in owner_params.items():
            out[name] = spec.init
    for party, shape in structure.z_shape.items():
        out[z_name(party)] = jnp.zeros(shape)
    out.update(values)
    return out


def owner_log_density(
    model: AugmentedModel,
    owner: str,
    values: dict,
    arrays: dict,
) -> jax.Array:
    """
    The owner's term of the augmented log joint: the summed (masked, scaled) log
    densities of the sample sites it owns, with every site's value taken from
    ``values`` (complete it with :func:`fill_values`).

    The server's term (``owner="server"``) is :math:`\\log p(y\\mid z,\\gamma) +
    \\log p(\\gamma)` in the augmented model; party :math:`j`'s is
    :math:`\\log p(z_j\\mid\\theta_j) + \\log p(\\theta_j)` (plus its power-likelihood
    copy). Summed over owners they give the log joint.

    :param AugmentedModel model: the augmented model.
    :param str owner: a party name or ``"server"``.
    :param dict values: site values (latents, auxiliaries, params, row indices).
    :param dict arrays: the owner's view of the data (keyword arguments).
    """
    seeded = handlers.seed(handlers.substitute(model, data=values), jax.random.key(0))
    tr = handlers.trace(seeded).get_trace(**arrays)
    total = jnp.zeros(())
    for site in tr.values():
        if site["type"] == "sample" and (party_of(site) or SERVER) == owner:
            total = total + site_log_prob(site)
    return total


def num_rows_in_batch(structure: VerticalStructure) -> int:
    """Rows per round (the subsample size, or all rows)."""
    shape = next(iter(structure.z_shape.values()))
    return int(np.prod(shape[:1]))
