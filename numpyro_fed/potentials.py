# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Per-silo potentials of a federated model in unconstrained space.

Stochastic-gradient samplers and surrogate fits need the pooled log density split into
a prior part and one log-likelihood part per silo, in unconstrained coordinates:

.. math::

    \\log \\pi(z) = \\underbrace{\\log p(z_G) + \\log|J_G|}_{\\text{prior}}
    + \\sum_s \\underbrace{\\log p(x_s, z_{L_s} \\mid z_G) + \\log|J_{L_s}|}_{
    \\text{silo } s},

where :math:`z_G` are the global sites, :math:`z_{L_s}` silo :math:`s`'s local sites
and the log-Jacobians of the transforms to each site's support go with the part that
holds the site. A minibatch of ``m`` units of a silo with :math:`N_s` real units is
scaled by :math:`N_s/m`, which makes it unbiased for the silo term; the sampler adds
the :math:`1/f_s` of the silo choice (El Mekkaoui et al., Eq. 4).

Positions are dicts of unconstrained values: a global site has its own shape; a local
site is stacked ``(J, P, ...)`` by silo and padded unit (units on the leading axis of
the site's value), like :class:`~numpyro_fed.FederatedData`.
"""

from typing import Any, Callable

import jax
from jax.flatten_util import ravel_pytree
import jax.numpy as jnp
from numpyro.infer.initialization import init_to_uniform

from numpyro_fed.densities import (
    constrain_site,
    data_template,
    real_entries,
    server_log_density,
    silo_log_density,
)
from numpyro_fed.partition import (
    ModelRoles,
    SiteSpec,
    analyze,
    init_values,
    nested_sizes,
    site_specs,
)
from numpyro_fed.util import constrain, unconstrain

__all__ = ["FederatedPotential", "batch_indices", "federated_potential"]


def batch_indices(
    key: jax.Array, num_real: jax.Array, padded: int, size: int, replace: bool = True
) -> jax.Array:
    """
    ``size`` unit slots drawn uniformly from the first ``num_real`` of ``padded`` slots
    (a silo's real units come first), with or without replacement. ``num_real`` may be
    traced, so one compiled step serves silos of every size.

    :param jax.random.key key: random key.
    :param num_real: number of real units of the silo.
    :param int padded: ``P``, the padded number of units.
    :param int size: ``m``, the minibatch size.
    :param bool replace: draw with replacement.
    :return: ``(m,)`` int32 slot indices.

    **Example:**

    .. doctest::

        >>> import jax
        >>> from numpyro_fed.potentials import batch_indices
        >>> idx = batch_indices(jax.random.key(0), 3, 5, 3, replace=False)
        >>> sorted(idx.tolist())
        [0, 1, 2]
    """
    if replace:
        u = jax.random.uniform(key, (size,))
        return jnp.minimum((u * num_real).astype(jnp.int32), num_real - 1)
    # Random keys with the padded slots pushed last: the first m of the order are a
    # uniform draw without replacement from the real units.
    u = jax.random.uniform(key, (padded,))
    u = jnp.where(jnp.arange(padded) < num_real, u, 2.0)
    return jnp.argsort(u)[:size].astype(jnp.int32)


class FederatedPotential:
    """
    The prior part and per-silo parts of a federated model's log density, in
    unconstrained space. Build it with :func:`federated_potential`.

    The constrained terms are :func:`~numpyro_fed.densities.server_log_density` and
    :func:`~numpyro_fed.densities.silo_log_density` (the terms the variational
    algorithms use), the log-Jacobians :func:`~numpyro_fed.densities.constrain_site`'s;
    padded units and padded entries of ragged nested plates contribute nothing.

    :ivar ModelRoles roles: the model's roles.
    :ivar tuple global_sites: :class:`~numpyro_fed.partition.SiteSpec` of each global
        latent site.
    :ivar tuple local_sites: :class:`~numpyro_fed.partition.SiteSpec` of each local
        latent site (per silo, units on axis 0 of ``unconstrained_shape``).
    :ivar dict nested: plate name -> ``(J,)`` real sizes of the ragged nested plates
        (:func:`~numpyro_fed.partition.nested_sizes`; empty when none), what
        :func:`~numpyro_fed.protocol.silo_data_of` gives each silo.
    :ivar int global_dim: size of the flattened global position.
    """

    def __init__(
        self,
        model: Callable,
        roles: ModelRoles,
        global_sites: tuple,
        local_sites: tuple,
        nested: dict,
        template: dict,
    ) -> None:
        self.model = model
        self.roles = roles
        self.global_sites = global_sites
        self.local_sites = local_sites
        self.nested = nested
        self._template = template
        self._specs = {s.name: s for s in global_sites + local_sites}
        zeros = {s.name: jnp.zeros(s.unconstrained_shape) for s in global_sites}
        flat, self._unravel = ravel_pytree(zeros)
        self.global_dim = int(flat.shape[0])

    # ------------------------------------------------------------------ helpers
    def flatten(self, z_global: dict) -> jax.Array:
        """The global position as one vector (the space of the surrogates)."""
        return ravel_pytree({s.name: z_global[s.name] for s in self.global_sites})[0]

    def unflatten(self, flat: jax.Array) -> dict:
        """Inverse of :meth:`flatten`."""
        return self._unravel(flat)

    def split(self, z: dict) -> tuple[dict, dict]:
        """``(global, local)`` parts of a position."""
        g = {s.name: z[s.name] for s in self.global_sites}
        loc = {s.name: z[s.name] for s in self.local_sites}
        return g, loc

    def constrain(self, z: dict) -> dict:
        """Constrained values of a position (global or local sites, any layout)."""
        return constrain({k: self._specs[k].support for k in z}, z)

    def unconstrain(self, values: dict) -> dict:
        """Inverse of :meth:`constrain`."""
        return unconstrain({k: self._specs[k].support for k in values}, values)

    def real_local(
        self, z_local: dict, mask: jax.Array | None, nested: dict | None = None
    ) -> dict:
        """
        Booleans shaped like each of a silo's local sites in ``z_local``, ``(P,
        ...)``: False at padded units (``mask``) and at padded entries of ragged
        nested plates (``nested``), the coordinates that carry no density.
        """
        out = {}
        for s in self.local_sites:
            shape = jnp.shape(z_local[s.name])
            keep = real_entries(s, shape, mask, nested)
            out[s.name] = jnp.ones(shape, bool) if keep is None else keep
        return out

    # ---------------------------------------------------------------- densities
    def log_prior(self, z_global: dict) -> jax.Array:
        """:math:`\\log p(z_G) + \\log|J_G|` (the sites outside the silo plate)."""
        values, log_p = {}, jnp.zeros(())
        for s in self.global_sites:
            values[s.name], log_det = constrain_site(s.support, z_global[s.name])
            log_p = log_p + jnp.sum(log_det)
        plate = self.roles.silo_plate
        return server_log_density(self.model, plate, self._template, values) + log_p

    def silo_log_likelihood(
        self,
        z_global: dict,
        z_local: dict,
        arrays: dict,
        mask: jax.Array | None,
        nested: dict | None = None,
    ) -> jax.Array:
        """
        Silo term :math:`\\log p(x_s, z_{L_s} \\mid z_G) + \\log|J_{L_s}|` over the
        silo's real units and real entries of its ragged nested plates.

        :param dict z_global: unconstrained global sites.
        :param dict z_local: the silo's unconstrained local sites, ``(P, ...)``.
        :param dict arrays: the silo's (padded) arrays.
        :param jax.Array mask: ``(P,)`` booleans for the real units, or ``None``.
        :param dict nested: plate name -> the silo's real size of each ragged nested
            plate (:attr:`nested` at the silo), or ``None``.
        """
        values, log_dets = self.constrain(z_global), []
        for s in self.local_sites:
            u = z_local[s.name]
            keep = real_entries(s, jnp.shape(u), mask, nested)
            values[s.name], log_det = constrain_site(s.support, u, keep)
            log_dets.append(jnp.sum(log_det))
        plate = self.roles.silo_plate
        log_p = silo_log_density(self.model, plate, arrays, mask, values, nested=nested)
        return sum(log_dets, log_p)

    def minibatch_log_likelihood(
        self,
        z_global: dict,
        z_local: dict,
        arrays: dict,
        idx: jax.Array,
        num_real: jax.Array,
        nested: dict | None = None,
    ) -> jax.Array:
        """
        :math:`\\frac{N_s}{m}` times the silo term on the units at slots ``idx``: an
        unbiased estimate of :meth:`silo_log_likelihood` when ``idx`` is uniform.

        :param jax.Array idx: ``(m,)`` slots of real units (see :func:`batch_indices`).
        :param num_real: :math:`N_s`.
        :param dict nested: as in :meth:`silo_log_likelihood`.
        """
        batch = {k: v[idx] for k, v in arrays.items()}
        local = {k: v[idx] for k, v in z_local.items()}
        term = self.silo_log_likelihood(z_global, local, batch, None, nested)
        return term * (num_real / idx.shape[0])

    # ------------------------------------------------------------ initial values
    def _init_values(self, key: jax.Array, arrays: dict, init_strategy: Callable):
        values = init_values(self.model, key, arrays, init_strategy, self._specs)
        return self.unconstrain(values)

    def init_position(
        self, key: jax.Array, data: Any, init_strategy: Callable = init_to_uniform
    ) -> dict:
        """
        An initial unconstrained position: global sites from silo 0's run of the model,
        local sites from each silo's run, under a NumPyro ``init_strategy``.

        :param jax.random.key key: random key.
        :param FederatedData data: the silos' data.
        :param callable init_strategy: e.g. ``init_to_uniform`` (the default),
            ``init_to_median``, ``init_to_sample``.
        """
        keys = jax.random.split(key, data.num_silos)
        init = jax.vmap(lambda a, k: self._init_values(k, a, init_strategy))
        stacked = init(dict(data.arrays), keys)
        out = {s.name: stacked[s.name][0] for s in self.global_sites}
        out.update({s.name: stacked[s.name] for s in self.local_sites})
        return out

    def init_global(
        self, key: jax.Array, init_strategy: Callable = init_to_uniform
    ) -> dict:
        """Initial global sites from the template (one unit of silo data)."""
        values = self._init_values(key, self._template, init_strategy)
        return self.split(values)[0]

    def init_local(
        self, key: jax.Array, arrays: dict, init_strategy: Callable = init_to_uniform
    ) -> dict:
        """Initial local sites of one silo, from its own (padded) arrays."""
        return self.split(self._init_values(key, arrays, init_strategy))[1]


def federated_potential(model: Callable, data: Any) -> FederatedPotential:
    """
    Trace a federated model on ``data`` and build its :class:`FederatedPotential`.

    Bind non-split arguments with :func:`functools.partial` before federating: the
    model is called with the silo arrays only.

    :param callable model: a model wrapped with :func:`~numpyro_fed.federate` or
        written with :class:`~numpyro_fed.silo_plate`.
    :param FederatedData data: the silos' data.
    :rtype: FederatedPotential
    :raises ValueError: for ``numpyro.param`` sites (a sampler needs every unknown
        to be a latent site) or the errors of :func:`~numpyro_fed.analyze` and
        :func:`~numpyro_fed.partition.nested_sizes`.
    :raises NotImplementedError: for a local site whose units are not its leading axis.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> from numpyro_fed.potentials import federated_potential
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
        ...     with nf.silo_plate("data", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
        >>> data = nf.FederatedData.from_groups([0, 1, 1], y=jnp.array([0.0, 1, 2]))
        >>> pot = federated_potential(model, data)
        >>> z = {"mu": jnp.array(0.5)}
        >>> round(float(pot.silo_log_likelihood(z, {}, data.silo(1), None)), 4)
        -3.0879
    """
    roles: ModelRoles = analyze(model, data)
    if roles.param_sites:
        raise ValueError(
            f"The model has numpyro.param site(s) {list(roles.param_sites)}: a sampler "
            "treats every unknown as a latent site. Give them priors (numpyro.sample) "
            "or fix them with numpyro.handlers.substitute."
        )
    padded = {k: v[0] for k, v in data.arrays.items()}
    specs, _ = site_specs(model, roles, padded, (), {})
    for name in roles.local_sites:
        spec: SiteSpec = specs[name]
        if spec.unit_axis != 0 or spec.unconstrained_shape[0] != data.padded_size:
            raise NotImplementedError(
                f"Local site {name!r} has its silo units on axis {spec.unit_axis} of "
                f"its value (shape {spec.shape}); samplers need the silo plate to be "
                "the value's leading axis."
            )
    return FederatedPotential(
        model,
        roles,
        tuple(specs[n] for n in roles.global_sites),
        tuple(specs[n] for n in roles.local_sites),
        nested_sizes(model, data, roles),
        data_template(data.silo(0)),
    )
