# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The structured Gaussian family of Hassan et al. (seed 000, §2.2).

.. math::

    z_G = \\mu_G + \\sigma_G \\odot L_G \\epsilon_G, \\qquad
    z_{L_j} = \\bar\\mu_j + C_j (z_G - \\mu_G) + \\sigma_j \\odot L_j \\epsilon_{L_j},

in the unconstrained space of every latent site (``biject_to(support)``), with
:math:`L` unit lower-triangular. Local factors are *per unit* of the silo plate (one
block per child, school or row), so the family does not change when units move
between silos: that is what makes SFVI partition-invariant.
"""

from collections.abc import Sequence
from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import numpyro
import numpyro.distributions as dist
from numpyro.distributions import biject_to, constraints
from numpyro.infer.autoguide import AutoGuide
from numpyro.infer.initialization import init_to_uniform

from numpyro_fed.densities import constrain_site, real_entries
from numpyro_fed.families import summaries
from numpyro_fed.families.gaussian import (
    cholesky_factor,
    gaussian_log_density,
    gaussian_log_density_terms,
    unit_tril,
)
from numpyro_fed.partition import (
    ModelRoles,
    SiteSpec,
    analyze,
    analyze_call,
    init_values,
    site_specs,
)
from numpyro_fed.util import key_batch_shape, unit_normals

__all__ = ["AutoMeanField", "AutoGlobalLocalNormal"]

GLOBAL_PREFIX = "_fed_global_"
LOCAL_PREFIX = "_fed_local_"


def _padded_silo(data: Any) -> dict:
    """Silo 0's units in the common padded layout: the local sites' shapes as every
    silo step sees them (ragged nested axes at their padded size)."""
    return _first_units(dict(data.arrays), data.sizes[0])


@partial(jax.jit, static_argnums=1)
def _first_units(arrays: dict, size: int) -> dict:
    return {k: v[0, :size] for k, v in arrays.items()}


class AutoGlobalLocalNormal(AutoGuide):
    """
    Structured Gaussian guide with a global factor and per-unit local factors that
    depend linearly on the global draw (Hassan et al., §2.2; Tan et al. 2020).

    It is an ordinary NumPyro guide (``SVI(model, AutoGlobalLocalNormal(model))`` runs
    centralized VI on pooled data) and it also exposes the pure functions the
    federated algorithms need, with an explicit split of the parameters into the
    server's global part :math:`\\eta_G` and each silo's local part :math:`\\eta_{L_j}`.

    :param callable model: a federated model (:class:`~numpyro_fed.federate` or
        :class:`~numpyro_fed.silo_plate`).
    :param str global_cov: ``"full"`` (unit lower-triangular :math:`L_G`) or ``"diag"``.
    :param bool coupling: learn :math:`C_j` (``True``) or fix it at zero.
    :param str local_cov: ``"diag"``; ``"full"`` for a full covariance within each
        unit's local latents; or ``"silo"`` for one full covariance over all the local
        latents of a silo (the paper's silo-wide :math:`L_j`: re-partitioning the units
        then changes the family, so SFVI is no longer partition-invariant).
    :param callable init_loc_fn: NumPyro init strategy for the locations.
    :param float init_scale: initial scale of every factor.

    **References:**

    1. *Federated Variational Inference Methods for Structured Latent Variable
       Models*, C. Hassan, R. Salomone, K. Mengersen.

    It is a NumPyro ``AutoGuide``: ``sample_posterior``, ``median``, ``quantiles``
    and ``get_posterior`` take ``svi.get_params(state)`` or a federated fit's
    ``result.params``, and ``Predictive(model, guide=guide, params=...)`` runs.

    Until version 0.1 this guide was called ``AutoStructured``; Pyro's
    ``AutoStructured`` is a different family (per-site dependencies chosen by the user).

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp, optax
        >>> import numpyro, numpyro.distributions as dist
        >>> from numpyro.infer import SVI, Trace_ELBO
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
        ...     with numpyro.plate("school", y.shape[0]):
        ...         theta = numpyro.sample("theta", dist.Normal(mu, 1))
        ...         numpyro.sample("y", dist.Normal(theta, 1), obs=y)
        >>> fed = nf.federate(model, silos="school")
        >>> guide = nf.AutoGlobalLocalNormal(fed)
        >>> svi = SVI(fed, guide, optax.adam(0.1), Trace_ELBO())
        >>> result = svi.run(jax.random.key(0), 10, y=jnp.ones(3), progress_bar=False)
        >>> sorted(result.params)  # doctest: +NORMALIZE_WHITESPACE
        ['_fed_global_loc', '_fed_global_scale', '_fed_global_tril',
         '_fed_local_coupling', '_fed_local_loc', '_fed_local_scale']
        >>> {k: v.shape for k, v in guide.median(result.params).items()}
        {'mu': (), 'theta': (3,)}
    """

    def __init__(
        self,
        model: Callable,
        *,
        global_cov: str = "full",
        coupling: bool = True,
        local_cov: str = "diag",
        init_loc_fn: Callable = init_to_uniform,
        init_scale: float = 0.1,
    ) -> None:
        if global_cov not in ("full", "diag"):
            raise ValueError(
                f"global_cov must be 'full' or 'diag', got {global_cov!r}."
            )
        if local_cov not in ("full", "diag", "silo"):
            raise ValueError(
                f"local_cov must be 'full', 'diag' or 'silo', got {local_cov!r}."
            )
        if not init_scale > 0:
            raise ValueError(f"init_scale must be positive, got {init_scale!r}.")
        super().__init__(model, prefix="_fed", init_loc_fn=init_loc_fn)
        self.global_cov = global_cov
        self.coupling = bool(coupling)
        self.local_cov = local_cov
        self.init_scale = float(init_scale)
        self.roles: ModelRoles | None = None
        self.global_specs: dict[str, SiteSpec] = {}
        self.local_specs: dict[str, SiteSpec] = {}
        self.param_specs: dict[str, Any] = {}

    # ------------------------------------------------------------------ set-up
    def setup(self, data: Any, *args: Any, **kwargs: Any) -> ModelRoles:
        """Analyze the model on federated data (idempotent for the same layout)."""
        roles = analyze(self.model, data, *args, **kwargs)
        self._setup(roles, _padded_silo(data), args, kwargs)
        return roles

    def check_model(self, model: Callable, data: Any, *args: Any, **kwargs: Any):
        """Raise unless ``model`` has this guide's latent sites (names, shapes,
        supports) and silo plate: an algorithm given a guide built for another model.

        :param callable model: the model the algorithm fits.
        :param FederatedData data: the federated data set.
        :raises ValueError: naming the sites that differ.
        """
        own = self.require_setup()
        if model is self.model:
            return
        roles = analyze(model, data, *args, **kwargs)
        specs, _ = site_specs(model, roles, _padded_silo(data), args, kwargs)
        mine = {**self.global_specs, **self.local_specs}

        def signature(spec):
            return spec.shape, spec.unit_axis is None, str(spec.support)

        differ = sorted(
            set(specs).symmetric_difference(mine)
            | {
                n
                for n in set(specs) & set(mine)
                if signature(specs[n]) != signature(mine[n])
            }
        )
        if differ or roles.silo_plate != own.silo_plate:
            raise ValueError(
                "The guide was built for another model: latent sites "
                f"{differ} differ (the model has {sorted(specs)} in silo plate "
                f"{roles.silo_plate!r}, the guide {sorted(mine)} in "
                f"{own.silo_plate!r}). Build it from the model you fit, e.g. "
                "nf.AutoGlobalLocalNormal(model)."
            )

    def _setup(self, roles: ModelRoles, arrays: dict, args: tuple, kwargs: dict):
        specs, params = site_specs(self.model, roles, arrays, args, kwargs)
        self.roles = roles
        self.global_specs = {n: specs[n] for n in roles.global_sites}
        self.local_specs = {n: specs[n] for n in roles.local_sites}
        self.param_specs = params

    @property
    def global_dim(self) -> int:
        """:math:`n_G`, the size of the unconstrained global vector."""
        return sum(
            int(np.prod(s.unconstrained_shape)) for s in self.global_specs.values()
        )

    @property
    def local_dim(self) -> int:
        """:math:`n_L`, unconstrained local coordinates per unit of the silo plate."""
        return sum(
            int(np.prod(s.unconstrained_shape)) // s.unconstrained_shape[s.local_axis]
            for s in self.local_specs.values()
        )

    def require_setup(self) -> ModelRoles:
        """The model's roles; raise unless the guide knows its model's sites."""
        if self.roles is None:
            raise RuntimeError(
                "The guide is not set up: call guide.setup(data), pass it to a "
                "numpyro_fed algorithm's init, or run it as a NumPyro guide (SVI) "
                "first."
            )
        return self.roles

    # --------------------------------------------------------------- parameters
    def theta_constraints(self) -> dict:
        """Constraints of the model's ``numpyro.param`` sites (theta)."""
        return {name: c for name, (_, c) in self.param_specs.items()}

    def param_constraints(self) -> tuple[dict, dict]:
        """Constraints of the global and local parameter dicts."""
        glob = {"loc": constraints.real, "scale": constraints.softplus_positive}
        if self.global_cov == "full" and self.global_dim > 0:
            glob["tril"] = constraints.real
        loc = {"loc": constraints.real, "scale": constraints.softplus_positive}
        if self.coupling and self.global_dim > 0:
            loc["coupling"] = constraints.real
        if self.local_cov == "full":
            loc["tril"] = constraints.real
        if self.local_cov == "silo":
            loc["silo_tril"] = constraints.real
        if self.global_dim == 0:
            glob = {}
        if self.local_dim == 0:
            loc = {}
        return glob, loc

    def _init_values(self, key, arrays, args, kwargs) -> dict:
        names = self.global_specs | self.local_specs
        return init_values(
            self.model, key, arrays, self.init_loc_fn, names, args, kwargs
        )

    def init_global(self, key: jax.Array, template: dict, args=(), kwargs=None) -> dict:
        """Initial (constrained) global parameters :math:`\\eta_G`."""
        self.require_setup()
        if self.global_dim == 0:
            return {}
        values = self._init_values(key, template, args, kwargs or {})
        loc = self._pack_global({n: values[n] for n in self.global_specs})
        n = self.global_dim
        eta = {"loc": loc, "scale": jnp.full((n,), self.init_scale, loc.dtype)}
        if self.global_cov == "full":
            eta["tril"] = jnp.zeros((n, n), loc.dtype)
        return eta

    def init_local(self, key: jax.Array, arrays: dict, args=(), kwargs=None) -> dict:
        """Initial (constrained) local parameters :math:`\\eta_L` for the units of
        ``arrays`` (leading axis of each local parameter = units)."""
        self.require_setup()
        if self.local_dim == 0:
            return {}
        values = self._init_values(key, arrays, args, kwargs or {})
        loc = self._pack_local({n: values[n] for n in self.local_specs})
        units, n = loc.shape
        eta = {"loc": loc, "scale": jnp.full((units, n), self.init_scale, loc.dtype)}
        if self.coupling and self.global_dim > 0:
            eta["coupling"] = jnp.zeros((units, n, self.global_dim), loc.dtype)
        if self.local_cov == "full":
            eta["tril"] = jnp.zeros((units, n, n), loc.dtype)
        if self.local_cov == "silo":
            eta["silo_tril"] = jnp.zeros((units * n, units * n), loc.dtype)
        return eta

    @property
    def units_separable(self) -> bool:
        """Whether every local parameter and noise draw belongs to one unit (units
        along axis 0, no factor across units): then all silos' units laid end to end
        give the same local terms as each silo's own (``local_cov="silo"`` ties a
        silo's units together)."""
        return self.local_cov != "silo"

    def num_units(self, eta_l: dict) -> int:
        """Units of the silo plate held by one silo's local parameters ``eta_l``."""
        return eta_l["loc"].shape[0]

    # ------------------------------------------------------------ vector layout
    def _pack_global(self, values: dict) -> jax.Array:
        flat = [
            jnp.reshape(biject_to(s.support).inv(values[n]), -1)
            for n, s in self.global_specs.items()
        ]
        return jnp.concatenate(flat)

    def _pack_local(self, values: dict) -> jax.Array:
        flat = []
        for n, s in self.local_specs.items():
            u = jnp.moveaxis(biject_to(s.support).inv(values[n]), s.local_axis, 0)
            flat.append(u.reshape(u.shape[0], -1))
        return jnp.concatenate(flat, axis=-1)

    def constrain_global(self, z: jax.Array) -> tuple[dict, jax.Array]:
        """Map the unconstrained global vector to site values; also return
        :math:`\\log|\\det J|` of the transforms."""
        values, log_det, start = {}, jnp.zeros((), z.dtype), 0
        for n, s in self.global_specs.items():
            size = int(np.prod(s.unconstrained_shape))
            u = z[start : start + size].reshape(s.unconstrained_shape)
            start += size
            values[n], ld = constrain_site(s.support, u)
            log_det = log_det + jnp.sum(ld)
        return values, log_det

    def constrain_local(
        self, z: jax.Array, mask: jax.Array | None = None
    ) -> tuple[dict, jax.Array]:
        """Map per-unit local vectors ``(units, n_L)`` to site values; also return the
        per-unit :math:`\\log|\\det J|`, shape ``(units,)``, over the coordinates
        where ``mask`` (``(units, n_L)``, :meth:`local_mask`) is True."""
        units = z.shape[0]
        values, log_det, start = {}, jnp.zeros((units,), z.dtype), 0
        for n, s in self.local_specs.items():
            shape = list(s.unconstrained_shape)
            shape.pop(s.local_axis)
            size = int(np.prod(shape))
            u = jnp.moveaxis(
                z[:, start : start + size].reshape((units, *shape)), 0, s.local_axis
            )
            keep = None
            if mask is not None:
                keep = mask[:, start : start + size].reshape((units, *shape))
                keep = jnp.moveaxis(keep, 0, s.local_axis)
            start += size
            values[n], ld = constrain_site(s.support, u, keep)
            ld = jnp.moveaxis(ld, s.local_axis, 0)
            log_det = log_det + ld.reshape(units, -1).sum(-1)
        return values, log_det

    def local_mask(self, nested: dict, units: int) -> jax.Array | None:
        """``(units, n_L)`` booleans, False for the local coordinates at padded
        entries of the ragged nested plates ``nested`` (plate name -> real size, as in
        :attr:`~numpyro_fed.protocol.SiloData.nested`); ``None`` when no local site
        lies in one of them."""
        specs = self.local_specs.values()
        if not any(plate in nested for s in specs for plate, _ in s.plates):
            return None
        blocks = []
        for s in specs:
            shape = list(s.unconstrained_shape)
            shape[s.local_axis] = units
            keep = real_entries(s, tuple(shape), None, nested)
            keep = jnp.ones(shape, bool) if keep is None else keep
            blocks.append(jnp.moveaxis(keep, s.local_axis, 0).reshape(units, -1))
        return jnp.concatenate(blocks, axis=-1)

    def restrict_local(self, eta_l: dict, mask: jax.Array | None) -> dict:
        """``eta_l`` with the covariance factors between real and padded local
        coordinates set to zero, so that the real coordinates' distribution is the
        same whatever the padding (``mask`` from :meth:`local_mask`)."""
        if mask is None:
            return eta_l
        eta_l = dict(eta_l)
        if "tril" in eta_l:
            eta_l["tril"] = eta_l["tril"] * (mask[:, :, None] & mask[:, None, :])
        if "silo_tril" in eta_l:
            flat = mask.reshape(-1)
            eta_l["silo_tril"] = eta_l["silo_tril"] * (flat[:, None] & flat[None, :])
        return eta_l

    # ------------------------------------------------------------ noise layout
    def global_noise(self, key: jax.Array) -> jax.Array:
        """:math:`\\epsilon_G` drawn from ``key`` (shared by the server and silos)."""
        return jax.random.normal(jax.random.fold_in(key, 0), (self.global_dim,))

    def local_noise(self, key: jax.Array, unit_ids: jax.Array) -> jax.Array:
        """:math:`\\epsilon_L` of the given units: unit ``i`` always gets the same draw
        from the same key, whichever silo holds it (row ``i`` of one pooled draw,
        :func:`~numpyro_fed.util.unit_normals`); ``key`` may be one key a silo
        (the leading axis of ``unit_ids``), as a ``vmap`` over silos would draw."""
        fold = jax.random.fold_in
        key = (
            jax.vmap(fold, (0, None))(key, 1) if key_batch_shape(key) else fold(key, 1)
        )
        return unit_normals(key, unit_ids, self.local_dim)

    # ----------------------------------------------------- sampling, densities
    def sample_global(self, eta_g: dict, eps: jax.Array) -> jax.Array:
        """:math:`z_G = \\mu_G + \\sigma_G \\odot L_G \\epsilon_G` (unconstrained)."""
        if "tril" in eta_g:
            eps = unit_tril(eta_g["tril"]) @ eps
        return eta_g["loc"] + eta_g["scale"] * eps

    def log_q_global(self, eta_g: dict, z: jax.Array) -> jax.Array:
        """:math:`\\log q_{\\eta_G}(z_G)` in unconstrained space."""
        return gaussian_log_density(z, eta_g["loc"], eta_g["scale"], eta_g.get("tril"))

    def _local_mean(self, eta_g: dict, eta_l: dict, z_g: jax.Array) -> jax.Array:
        mean = eta_l["loc"]
        if "coupling" in eta_l:
            mean = mean + eta_l["coupling"] @ (z_g - eta_g["loc"])
        return mean

    def sample_local(self, eta_g, eta_l, z_g, eps) -> jax.Array:
        """:math:`z_{L} = \\bar\\mu + C (z_G - \\mu_G) + \\sigma \\odot L \\epsilon_L`,
        one row per unit."""
        if "tril" in eta_l:
            eps = jnp.einsum("uij,uj->ui", unit_tril(eta_l["tril"]), eps)
        if "silo_tril" in eta_l:
            eps = (unit_tril(eta_l["silo_tril"]) @ eps.reshape(-1)).reshape(eps.shape)
        mean = self._local_mean(eta_g, eta_l, z_g)
        # As one axis: see numpyro_fed.util.constrain.
        flat = mean.reshape(-1) + eta_l["scale"].reshape(-1) * eps.reshape(-1)
        return flat.reshape(eps.shape)

    def log_q_local(self, eta_g, eta_l, z_g, z_l, mask=None) -> jax.Array:
        """Per-unit :math:`\\log q(z_{L} \\mid z_G)`, shape ``(units,)``. With
        ``local_cov="silo"`` the units are not independent: the terms are the chain-rule
        factors :math:`\\log q(z_{L,u} \\mid z_{L,<u}, z_G)`, which sum to the joint, so
        masking trailing (padded) units stays exact. ``mask`` (:meth:`local_mask`)
        leaves out padded coordinates of ragged nested plates; pass ``eta_l`` through
        :meth:`restrict_local` first so that they do not condition the real ones."""
        mean = self._local_mean(eta_g, eta_l, z_g)
        if "tril" in eta_l:
            return jax.vmap(gaussian_log_density)(
                z_l, mean, eta_l["scale"], eta_l["tril"], mask
            )
        # The units' coordinates as one axis (numpyro_fed.util.constrain says
        # why); with "silo_tril" they are one Gaussian vector.
        z, loc, scale = (a.reshape(-1) for a in (z_l, mean, eta_l["scale"]))
        terms = gaussian_log_density_terms(z, loc, scale, eta_l.get("silo_tril"))
        if mask is not None:
            terms = jnp.where(mask.reshape(-1), terms, 0.0)
        return terms.reshape(z_l.shape).sum(-1)

    # ------------------------------------------------------------ NumPyro guide
    def _setup_from_call(self, args: tuple, kwargs: dict) -> None:
        if self.roles is None:
            self._setup(analyze_call(self.model, args, kwargs), {}, args, kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        self._setup_from_call(args, kwargs)
        glob_c, loc_c = self.param_constraints()
        # The noise key comes first, before any plate asks the seed handler for one,
        # so that federated runs can reproduce it (see numpyro_fed.algorithms.sfvi).
        key = numpyro.prng_key()

        cache: dict = {}

        def lazy(init_fn, field):
            # One init call per part (global, local), shared by its fields, so that
            # fields drawn together (an encoder and its inputs) stay consistent.
            def init(rng_key):
                if init_fn not in cache:
                    cache[init_fn] = init_fn(rng_key, {}, args, kwargs)
                return cache[init_fn][field]

            return init

        eta_g = {
            k: numpyro.param(GLOBAL_PREFIX + k, lazy(self.init_global, k), constraint=c)
            for k, c in glob_c.items()
        }
        eta_l = {
            k: numpyro.param(LOCAL_PREFIX + k, lazy(self.init_local, k), constraint=c)
            for k, c in loc_c.items()
        }
        values, log_q = self.draw(eta_g, eta_l, key, None)
        numpyro.sample(
            "_fed_latent",
            dist.Delta(jnp.zeros(()), log_density=log_q),
            infer={"is_auxiliary": True},
        )
        for name, spec in self.global_specs.items():
            numpyro.sample(name, dist.Delta(values[name], event_dim=spec.event_dim))
        if self.local_specs:
            units = self.num_units(eta_l)
            own = self.require_setup()
            with numpyro.plate(own.silo_plate, units, dim=own.silo_dim):
                for name, spec in self.local_specs.items():
                    delta = dist.Delta(values[name], event_dim=spec.event_dim)
                    numpyro.sample(name, delta)
        return values

    def draw(self, eta_g, eta_l, key, unit_ids=None) -> tuple[dict, jax.Array]:
        """One joint draw of every latent site from ``key`` with the documented noise
        layout, and :math:`\\log q` of it in constrained space."""
        z_g, values, log_q = self.draw_global(eta_g, key)
        if eta_l:
            if unit_ids is None:
                unit_ids = jnp.arange(self.num_units(eta_l))
            local_values, log_q_local = self.draw_local(
                eta_g, eta_l, z_g, key, unit_ids
            )
            values = {**values, **local_values}
            log_q = log_q + jnp.sum(log_q_local)
        return values, log_q

    def draw_global(self, eta_g: dict, key: jax.Array):
        """Draw :math:`z_G`; return it (unconstrained), the site values and
        :math:`\\log q(x_G)` in constrained space."""
        if not eta_g:
            return jnp.zeros((0,)), {}, jnp.zeros(())
        z_g = self.sample_global(eta_g, self.global_noise(key))
        values, log_det = self.constrain_global(z_g)
        return z_g, values, self.log_q_global(eta_g, z_g) - log_det

    def draw_local(self, eta_g, eta_l, z_g, key, unit_ids):
        """Draw the local sites of the given units given :math:`z_G`; return the site
        values and the per-unit :math:`\\log q(x_L \\mid z_G)` in constrained space."""
        z_l = self.sample_local(eta_g, eta_l, z_g, self.local_noise(key, unit_ids))
        values, log_det = self.constrain_local(z_l)
        return values, self.log_q_local(eta_g, eta_l, z_g, z_l) - log_det

    # ------------------------------------------------ NumPyro AutoGuide summaries
    def local_marginal(self, eta_g: dict, eta_l: dict) -> tuple[jax.Array, jax.Array]:
        """Mean and standard deviation ``(units, n_L)`` of each unconstrained local
        coordinate with :math:`z_G` integrated out: the variance is
        :math:`\\mathrm{diag}(C_j \\Sigma_G C_j^\\top + \\Sigma_{L_j})`."""
        scale = eta_l["scale"]
        if "silo_tril" in eta_l:
            flat = cholesky_factor(scale.reshape(-1), eta_l["silo_tril"])
            var = jnp.sum(flat**2, -1).reshape(scale.shape)
        else:
            var = jnp.sum(cholesky_factor(scale, eta_l.get("tril")) ** 2, -1)
        if "coupling" in eta_l:
            factor = cholesky_factor(eta_g["scale"], eta_g.get("tril"))
            var = var + jnp.sum((eta_l["coupling"] @ factor) ** 2, -1)
        return eta_l["loc"], jnp.sqrt(var)

    def sample_posterior(
        self,
        rng_key: jax.Array,
        params: Any,
        *args: Any,
        sample_shape: tuple[int, ...] = (),
        **kwargs: Any,
    ) -> dict[str, jax.Array]:
        """Joint draws of every latent site, ``sample_shape`` first.

        :param jax.random.key rng_key: random key.
        :param params: NumPyro's parameters of this guide (``svi.get_params(state)``)
            or a federated fit's (``result.params``: local sites stacked by silo; see
            :mod:`~numpyro_fed.families.summaries`).
        :param args: the model's arguments, only to set up a fresh guide.
        :param tuple sample_shape: leading shape of the draws.
        :param kwargs: the model's keyword arguments, as ``args``.
        :return: dict site name -> draws.
        """
        self._setup_from_call(args, kwargs)
        return summaries.sample_posterior(self, rng_key, params, sample_shape)

    def median(self, params: Any) -> dict[str, jax.Array]:
        """Every latent site at :math:`T(\\mu)`, its support's bijection of the
        unconstrained location (each coordinate's median when :math:`T` is
        elementwise and monotone). ``params`` as for :meth:`sample_posterior`."""
        return summaries.median(self, params)

    def quantiles(
        self, params: Any, quantiles: Sequence[float] | jax.Array
    ) -> dict[str, jax.Array]:
        """Each unconstrained coordinate's Normal marginal quantiles (local ones with
        the coupling's share of :math:`z_G`'s variance), constrained, as NumPyro's
        ``AutoNormal`` does: a leading ``len(quantiles)`` axis, levels in
        ``(0, 1)``. ``params`` as for :meth:`sample_posterior`."""
        return summaries.quantiles(self, params, quantiles)

    def get_posterior(self, params: Any) -> dist.MultivariateNormal:
        """The exact joint Gaussian of the unconstrained latent vector: :math:`z_G`,
        then unit by unit :math:`z_{L_u}` (``z[global_dim:].reshape(units,
        local_dim)``; :meth:`constrain_global`, :meth:`constrain_local` give site
        values), cross-covariances :math:`C_j \\Sigma_G` included. Dense: for many
        units use :meth:`sample_posterior`.

        :param params: NumPyro's parameters of this guide, or
            ``svi.pooled_params(result.params, data)`` after a federated fit (its
            ``result.params`` without local parameters give the global block).
        :rtype: ~numpyro.distributions.MultivariateNormal
        """
        return summaries.joint_posterior(self, params)


def AutoMeanField(model: Callable, **kwargs: Any) -> AutoGlobalLocalNormal:
    """Mean-field Gaussian guide: :class:`AutoGlobalLocalNormal` with diagonal global and
    local factors and no coupling.

    :param callable model: a federated model.
    """
    return AutoGlobalLocalNormal(
        model, global_cov="diag", coupling=False, local_cov="diag", **kwargs
    )
