# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Trace a federated model once and derive the role of every site."""

from typing import Any, Callable, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from numpyro import handlers
import numpyro.distributions as dist
from numpyro.distributions import biject_to, constraints
from numpyro.infer.inspect import get_model_relations

from numpyro_fed.handlers import federate, silo_plate_name

__all__ = [
    "ModelRoles",
    "SiteSpec",
    "analyze",
    "analyze_call",
    "call_model",
    "init_values",
    "nested_sizes",
    "site_specs",
]


class SiteSpec(NamedTuple):
    """Static description of one latent site, used by variational families.

    - **name** - site name.
    - **shape** - constrained value shape (for a local site, per silo, with the unit
      axis at ``unit_axis``).
    - **unconstrained_shape** - shape of the unconstrained value (same convention).
    - **unit_axis** - axis of the silo plate in the value, or ``None`` for a global site.
    - **support** - the site's support constraint.
    - **event_dim** - event dimension of the site's distribution.
    - **plates** - ``(plate name, axis)`` of every other plate the site lies in, with
      the plate's axis in the value (the unit axis not removed).
    """

    name: str
    shape: tuple
    unconstrained_shape: tuple
    unit_axis: int | None
    support: Any
    event_dim: int
    plates: tuple = ()

    @property
    def local_axis(self) -> int:
        """``unit_axis`` of a local site (an error for a global one)."""
        if self.unit_axis is None:
            raise ValueError(f"Site {self.name!r} is global: it has no unit axis.")
        return self.unit_axis


class ModelRoles(NamedTuple):
    """Roles of the sites of a federated model.

    - **silo_plate** - name of the plate whose indices are split across silos.
    - **silo_dim** - the plate's (negative) batch dimension.
    - **silo_size** - number of units of the pooled data set.
    - **global_sites** - latent sample sites outside the silo plate (Z_G).
    - **local_sites** - latent sample sites inside the silo plate (Z_L).
    - **observed_sites** - observed sites inside the silo plate (the silos' likelihood).
    - **param_sites** - ``numpyro.param`` sites of the model (theta, global).
    - **factor_sites** - ``numpyro.factor`` sites outside the silo plate: prior terms
      of the global sites, part of the server's term.
    """

    silo_plate: str
    silo_dim: int
    silo_size: int
    global_sites: tuple[str, ...]
    local_sites: tuple[str, ...]
    observed_sites: tuple[str, ...]
    param_sites: tuple[str, ...]
    factor_sites: tuple[str, ...] = ()


def call_model(model: Callable, arrays: dict, args: tuple, kwargs: dict) -> Any:
    """Run ``model`` on one silo's (or the pooled) arrays plus shared arguments."""
    return model(*args, **kwargs, **arrays)


def _trace(model: Callable, arrays: dict, args: tuple, kwargs: dict) -> dict:
    seeded = handlers.seed(model, jax.random.key(0))
    # block(): the trace may run inside a guide, whose handlers must not see it.
    with handlers.block():
        return handlers.trace(seeded).get_trace(*args, **kwargs, **arrays)


def _plate_frames(trace: dict) -> dict[str, Any]:
    frames = {}
    for site in trace.values():
        for frame in site.get("cond_indep_stack", ()):
            frames[frame.name] = frame
    return frames


def _silo_plate(model: Callable, trace: dict) -> str:
    names = {n for s in trace.values() if (n := silo_plate_name(s)) is not None}
    plates = [n for n, s in trace.items() if s["type"] == "plate"]
    if isinstance(model, federate):
        if model.silos not in plates:
            raise ValueError(
                f"federate(model, silos={model.silos!r}): the model has no plate named "
                f"{model.silos!r}; its plates are {plates}."
            )
        return model.silos
    if not names:
        raise ValueError(
            "The model has no silo plate: wrap it as nf.federate(model, silos="
            f"'<plate name>') (its plates are {plates}) or write nf.silo_plate(...) "
            "in place of the numpyro.plate that runs over silos."
        )
    if len(names) > 1:
        raise ValueError(
            f"The model marks several silo plates {sorted(names)}: use one."
        )
    return names.pop()


def _check_dependencies(model, arrays, args, kwargs, global_sites, local_sites):
    try:
        relations = get_model_relations(
            model, model_args=args, model_kwargs={**kwargs, **arrays}
        )
    except Exception as err:  # provenance tracing is best-effort for exotic models
        warnings.warn(
            f"Could not trace site dependencies ({err!r}); skipping the check that "
            "global sites do not depend on local ones.",
            stacklevel=3,
        )
        return
    local = set(local_sites)
    for name in global_sites:
        upstream = local.intersection(relations["sample_sample"].get(name, ()))
        if upstream:
            raise ValueError(
                f"Global site {name!r} depends on local site(s) {sorted(upstream)} of "
                "the silo plate; a global variable must not depend on one silo's "
                "latents. Move it inside the silo plate or restructure the model."
            )


def analyze(model: Callable, data: Any, *args: Any, **kwargs: Any) -> ModelRoles:
    """
    Trace a federated model once and return the role of every site.

    The model runs on silo 0's own arrays (so a silo plate whose size does not
    follow the data is caught here), plus any shared ``args``/``kwargs``.

    :param callable model: a model wrapped with :class:`~numpyro_fed.federate` or
        written with :class:`~numpyro_fed.silo_plate`.
    :param FederatedData data: the federated data set.
    :return: the model's roles.
    :rtype: ModelRoles
    :raises ValueError: for a model with no silo plate, an unknown plate name, a plate
        sized differently from the data, an observed site outside the silo plate, a
        discrete latent site, or a global site that depends on a local one.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
        ...     with numpyro.plate("data", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
        >>> data = nf.FederatedData.from_groups([0, 1, 1], y=jnp.ones(3))
        >>> roles = nf.partition.analyze(nf.federate(model, silos="data"), data)
        >>> roles.global_sites, roles.observed_sites
        (('mu',), ('y',))
    """
    arrays = data.silo(0)
    trace = _trace(model, arrays, args, kwargs)
    roles = _roles(model, trace, data.num_units)
    plate_site = trace[roles.silo_plate]
    size = int(plate_site["args"][0])
    _check_not_subsampled(roles.silo_plate, plate_site, 0)
    largest = int(np.argmax(data.sizes))
    if data.sizes[largest] > data.sizes[0]:  # a fixed subsample_size shows there
        run = _trace(model, data.silo(largest), args, kwargs)
        _check_not_subsampled(roles.silo_plate, run[roles.silo_plate], largest)
    if size != data.sizes[0]:
        raise ValueError(
            f"Silo plate {roles.silo_plate!r} has size {size} when the model runs on "
            f"silo 0, which holds {data.sizes[0]} units: size the plate from the data "
            "(e.g. X.shape[0]) so that each silo's run sees its own units, and split "
            "every array along that plate's axis."
        )
    _check_global_shapes(model, roles, trace, arrays, args, kwargs)
    _check_dependencies(
        model, arrays, args, kwargs, roles.global_sites, roles.local_sites
    )
    return roles


def _check_not_subsampled(plate: str, site: dict, silo: int) -> None:
    size, subsample_size = site["args"][:2]
    if subsample_size is not None and int(subsample_size) != int(size):
        raise ValueError(
            f"The silo plate {plate!r} has subsample_size={subsample_size} (silo "
            f"{silo} holds {size} units): each silo evaluates all of its own units, "
            "so the silo plate cannot be subsampled. Remove subsample_size (to visit "
            "fewer silos per round, use the algorithm's participation option)."
        )


def _check_global_shapes(model, roles, trace, arrays, args, kwargs) -> None:
    """Global sites must not change with the number of units: run the model on one
    and on two units (silo 0's first, repeated). Each run is seeded alike, so global
    sites of equal shapes take equal values."""
    names = roles.global_sites + roles.param_sites + roles.factor_sites
    runs = {len(next(iter(arrays.values()))): trace}
    for units in (1, 2):
        # numpy: eager jnp.repeat would compile a program per array.
        few: dict[str, Any] = {
            k: np.repeat(np.asarray(v)[:1], units, axis=0) for k, v in arrays.items()
        }
        if roles.factor_sites:  # their values are compared: run the model
            few = {k: jnp.asarray(v) for k, v in few.items()}
            runs[units] = _trace(model, few, args, kwargs)
        else:
            runs[units] = _abstract_run(model, names, few, args, kwargs)
    plate = roles.silo_plate
    for name in names:
        shapes = {n: tuple(jnp.shape(t[name]["value"])) for n, t in runs.items()}
        if len(set(shapes.values())) > 1:
            where = ", ".join(
                f"{s} with {n} unit(s)" for n, s in sorted(shapes.items())
            )
            raise ValueError(
                f"Site {name!r} lies outside the silo plate {plate!r} but its shape "
                f"follows the number of units ({where}): it is per unit, not global. "
                f"Sample it inside the plate {plate!r} (e.g. under the same "
                "numpyro.plate as the observations)."
            )
    for name in roles.factor_sites:
        logs = [np.asarray(t[name]["fn"].log_factor) for t in runs.values()]
        if not all(np.allclose(logs[0], x, rtol=1e-6, atol=0) for x in logs[1:]):
            raise ValueError(
                f"numpyro.factor {name!r} lies outside the silo plate {plate!r} but "
                "its value depends on the silo's data; the server evaluates global "
                "terms without data. Move it inside the plate (a likelihood term of "
                "the units) or make it a function of global sites only."
            )


def _abstract_run(model, names, arrays, args, kwargs) -> dict:
    """``{name: {"value": shape}}`` of the named sites on ``arrays``, traced
    abstractly (nothing compiles); run eagerly when the model needs concrete values
    (Python control flow on data)."""

    def values(arrays: dict) -> dict:
        trace = _trace(model, arrays, args, kwargs)
        return {name: {"value": trace[name]["value"]} for name in names}

    try:
        return jax.eval_shape(values, arrays)
    except Exception:  # the eager run raises the model's own error, if any
        return values({k: jnp.asarray(v) for k, v in arrays.items()})


def analyze_call(model: Callable, args: tuple, kwargs: dict) -> ModelRoles:
    """Roles from one run of ``model(*args, **kwargs)`` (no data checks): what a
    guide uses when NumPyro calls it with the pooled data."""
    trace = _trace(model, {}, args, kwargs)
    plate = _silo_plate(model, trace)
    return _roles(model, trace, int(trace[plate]["args"][0]))


def _roles(model: Callable, trace: dict, num_units: int) -> ModelRoles:
    plate = _silo_plate(model, trace)
    frame = _plate_frames(trace).get(plate)
    if frame is None:
        raise ValueError(f"The silo plate {plate!r} holds no site of the model.")
    global_sites: list[str] = []
    local_sites: list[str] = []
    observed: list[str] = []
    params: list[str] = []
    factors: list[str] = []
    for name, site in trace.items():
        inside = silo_plate_name(site) == plate
        if site["type"] == "param":
            if inside:
                raise NotImplementedError(
                    f"numpyro.param site {name!r} lies inside the silo plate {plate!r}; "
                    "per-silo parameters are not supported yet: make it a latent site."
                )
            params.append(name)
        elif site["type"] == "sample":
            if site["is_observed"]:
                if not inside and isinstance(site["fn"], dist.Unit):
                    factors.append(name)
                    continue
                if not inside:
                    raise ValueError(
                        f"Observed site {name!r} lies outside the silo plate {plate!r}: "
                        "its data would belong to no silo. Put it inside the plate."
                    )
                observed.append(name)
            else:
                if site["fn"].support.is_discrete:
                    raise ValueError(
                        f"Latent site {name!r} is discrete; federated VI needs "
                        "continuous latent sites (marginalize it out of the model)."
                    )
                (local_sites if inside else global_sites).append(name)
    return ModelRoles(
        silo_plate=plate,
        silo_dim=int(frame.dim),
        silo_size=int(num_units),
        global_sites=tuple(global_sites),
        local_sites=tuple(local_sites),
        observed_sites=tuple(observed),
        param_sites=tuple(params),
        factor_sites=tuple(factors),
    )


def site_specs(
    model: Callable, roles: ModelRoles, arrays: dict, args: tuple, kwargs: dict
) -> tuple[dict[str, SiteSpec], dict[str, Any]]:
    """Shapes and supports of the latent sites, and the model's param sites.

    :return: ``(specs, params)`` where ``params`` maps each param site to
        ``(init_value, constraint)``.
    """
    trace = _trace(model, arrays, args, kwargs)
    specs = {}
    for name in roles.global_sites + roles.local_sites:
        site = trace[name]
        value = jnp.asarray(site["value"])
        support = site["fn"].support
        event_dim = site["fn"].event_dim
        unconstrained = jax.eval_shape(biject_to(support).inv, value).shape
        unit_axis = None
        if name in roles.local_sites:
            unit_axis = value.ndim - event_dim + roles.silo_dim
        plates = tuple(
            (f.name, value.ndim - event_dim + f.dim)
            for f in site["cond_indep_stack"]
            if f.name != roles.silo_plate
        )
        specs[name] = SiteSpec(
            name,
            tuple(value.shape),
            tuple(unconstrained),
            unit_axis,
            support,
            event_dim,
            plates,
        )
    params = {}
    for name in roles.param_sites:
        site = trace[name]
        constraint = site["kwargs"].get("constraint") or constraints.real
        params[name] = (np.asarray(site["value"]), constraint)
    return specs, params


def init_values(
    model: Callable,
    key: jax.Array,
    arrays: dict,
    init_strategy: Callable,
    names: Any,
    args: tuple = (),
    kwargs: dict | None = None,
) -> dict:
    """Constrained initial values of the sites ``names`` from one run of ``model`` on
    ``arrays`` under a NumPyro init strategy (``init_to_uniform``, ...)."""
    seeded = handlers.substitute(handlers.seed(model, key), substitute_fn=init_strategy)
    # block(): the run may happen inside a guide, whose handlers must not see it.
    with handlers.block():
        trace = handlers.trace(seeded).get_trace(*args, **(kwargs or {}), **arrays)
    return {name: trace[name]["value"] for name in names}


def _plate_sizes(trace: dict, plates: set) -> dict[str, int]:
    return {
        f.name: int(f.size)
        for site in trace.values()
        for f in site.get("cond_indep_stack", ())
        if f.name in plates
    }


def nested_sizes(
    model: Callable, data: Any, roles: ModelRoles, *args: Any, **kwargs: Any
) -> dict[str, np.ndarray]:
    """
    Each silo's real size of every plate nested in the silo plate that is ragged
    across silos (one county per silo, each with its own number of homes).

    Silos are padded to a common shape, so a nested plate sized from the data has its
    padded size in every silo's run; its entries beyond the silo's real size are
    padding, which :class:`~numpyro_fed.densities.silo_mask` and the guide mask out.
    The real sizes come from running the model on each silo's own (unpadded) arrays,
    once per distinct shape.

    :param callable model: the federated model.
    :param FederatedData data: the federated data set.
    :param ModelRoles roles: the model's roles (:func:`analyze`).
    :return: plate name -> ``(J,)`` int32 real sizes (empty when no array is ragged).
    :raises ValueError: naming the site and silo, when a ragged array reaches a
        site along an axis that is not a plate nested in the silo plate (an event
        axis, or an axis outside the silo plate), where padding cannot be masked.
    """
    if not data.ragged:
        return {}
    padded = _trace(model, {k: v[0] for k, v in data.arrays.items()}, args, kwargs)
    inner = {
        f.name
        for site in padded.values()
        if site["type"] == "sample" and silo_plate_name(site) == roles.silo_plate
        for f in site["cond_indep_stack"]
        if f.name != roles.silo_plate
    }
    full = _plate_sizes(padded, inner)
    sizes = {
        name: np.full(data.num_silos, size, np.int32) for name, size in full.items()
    }
    seen: dict[tuple, int] = {}
    for j, shapes in enumerate(data.silo_shapes):
        signature = tuple(shape[1:] for shape in shapes.values())
        if signature in seen:
            for name in sizes:
                sizes[name][j] = sizes[name][seen[signature]]
            continue
        seen[signature] = j
        own = _trace(model, data.silo(j), args, kwargs)
        for name, size in _plate_sizes(own, inner).items():
            sizes[name][j] = size
        _check_ragged_sites(own, padded, roles.silo_plate, j)
    return {name: s for name, s in sizes.items() if (s != full[name]).any()}


def _check_ragged_sites(own: dict, padded: dict, plate: str, silo: int) -> None:
    """Sites of a silo's own run may differ from the padded run only along plates
    nested in the silo plate (or the silo plate itself)."""
    for name, site in padded.items():
        if site["type"] not in ("sample", "param") or name not in own:
            continue
        shape, real = jnp.shape(site["value"]), jnp.shape(own[name]["value"])
        if shape == real:
            continue
        event_dim = site["fn"].event_dim if site["type"] == "sample" else 0
        inside = silo_plate_name(site) == plate
        masked = {
            len(shape) - event_dim + f.dim
            for f in site.get("cond_indep_stack", ())
            if inside
        }
        axes = [i for i, (a, b) in enumerate(zip(shape, real, strict=False)) if a != b]
        if len(shape) != len(real) or not set(axes) <= masked:
            where = "inside" if inside else "outside"
            raise ValueError(
                f"Site {name!r} ({where} the silo plate {plate!r}) has shape "
                f"{tuple(real)} on silo {silo}'s own data but {tuple(shape)} once "
                "silos are padded to a common shape, along an axis that is not a "
                f"plate nested in {plate!r}: padding there cannot be masked. Put "
                f"that axis under a numpyro.plate inside {plate!r} (a ragged event "
                "dimension or a global site sized by ragged data cannot be federated)."
            )
