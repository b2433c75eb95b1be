# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Trace an augmented model once and split it by owner: each party's latents,
auxiliary and parameters, the server's latents and parameters; then evaluate each
owner's log-density term on the owner's own view of the data."""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from numpyro import handlers
from numpyro.distributions import biject_to, constraints
from numpyro.infer.inspect import get_dependencies

from numpyro_fed.densities import sum_log_probs
from numpyro_fed.vertical.augment import AugmentedModel, VerticalModelError, z_name
from numpyro_fed.vertical.markers import party_of

__all__ = [
    "LatentSpec",
    "VerticalStructure",
    "fill_values",
    "likelihood_dependencies",
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


def likelihood_dependencies(model: AugmentedModel, arrays: dict) -> dict:
    """
    The latent sites each observed site of ``model`` reads directly (its parents in
    :func:`numpyro.infer.inspect.get_dependencies`), checked against the split:
    an owner's observed site may read the server's latents, its own latents (a
    party's power-likelihood copy reads its exact :math:`g_j`) and *other* parties'
    auxiliaries :math:`z_k`, nothing else. In the augmented model the likelihood
    :math:`p(y\\mid z,\\gamma)` thus reads party :math:`j` only through
    :math:`z_j`, which is what lets the server evaluate it without any
    :math:`\\theta_j`.

    The check sees ``sample`` sites only: a party's ``numpyro.param`` used in the
    likelihood is not a site of the dependency graph (the gradient of
    :func:`owner_log_density` with respect to it reveals it).

    :param AugmentedModel model: from :func:`~numpyro_fed.augment`.
    :param dict arrays: the model's keyword arguments (e.g. ``data.pooled()``).
    :return: observed site -> sorted tuple of the latent sites it reads.
    :raises VerticalModelError: if an observed site reads another party's latent
        (e.g. a :math:`\\theta_j` in the likelihood's scale) or its own auxiliary.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> from numpyro_fed.vertical.structure import likelihood_dependencies
        >>> def model(x1, x2, y=None):
        ...     s = numpyro.sample("s", dist.HalfNormal(1.0))
        ...     with nf.vertical("a"):
        ...         e1 = nf.contribution("a", x1 * numpyro.sample("b1", dist.Normal(0, 1)))
        ...     with nf.vertical("b"):
        ...         e2 = nf.contribution("b", x2 * numpyro.sample("b2", dist.Normal(0, 1)))
        ...     with numpyro.plate("rows", x1.shape[0]):
        ...         numpyro.sample("y", dist.Normal(e1 + e2, s), obs=y)
        >>> likelihood_dependencies(nf.augment(model, 0.5), dict(x1=jnp.ones(3), x2=jnp.ones(3), y=jnp.zeros(3)))
        {'y': ('a/z', 'b/z', 's')}
    """
    if not isinstance(model, AugmentedModel):
        raise TypeError(
            "Expected an augmented model (nf.augment(model, rho, kind)), got "
            f"{type(model).__name__}."
        )
    tr = handlers.trace(handlers.seed(model, jax.random.key(0))).get_trace(**arrays)
    latent_owner = {
        name: party_of(site) or SERVER
        for name, site in tr.items()
        if site["type"] == "sample" and not site["is_observed"]
    }
    aux_of = {z_name(p): p for p in set(latent_owner.values()) - {SERVER}}
    deps = get_dependencies(model, model_kwargs=arrays)["prior_dependencies"]
    out = {}
    for name, site in tr.items():
        if site["type"] != "sample" or not site["is_observed"]:
            continue
        owner = party_of(site) or SERVER
        parents = tuple(sorted(k for k in deps.get(name, {}) if k != name))
        for parent in parents:
            holder = latent_owner.get(parent, SERVER)
            if parent in aux_of:
                ok = aux_of[parent] != owner
            else:
                ok = holder in (SERVER, owner)
            if not ok:
                what = "its own auxiliary" if holder == owner else f"party {holder!r}'s"
                raise VerticalModelError(
                    f"Observed site {name!r} (held by {owner!r}) reads {what} latent "
                    f"{parent!r} directly: a party may enter another owner's "
                    "likelihood only through its contribution (nf.contribution), "
                    "which the augmented model replaces by its auxiliary."
                )
        out[name] = parents
    return out


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
    return sum_log_probs(tr, lambda site: (party_of(site) or SERVER) == owner)
