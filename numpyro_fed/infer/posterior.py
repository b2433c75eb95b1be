# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Posterior draws from a fitted structured family, shared by the VI wrappers."""

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["sample_structured"]


def sample_structured(
    guide: Any, rng_key: jax.Array, params: Any, data: Any, num_samples: int
) -> dict[str, jax.Array]:
    """Draws of every latent site from :math:`q(z_G) \\prod_j q(z_{L_j} \\mid z_G)`.

    :param guide: an :class:`~numpyro_fed.AutoGlobalLocalNormal` guide, set up.
    :param params: constrained parameters with fields ``eta_global`` and ``eta_local``
        (local ones stacked ``(J, P, ...)``).
    :param data: a :class:`~numpyro_fed.FederatedData` to return local sites in the
        pooled layout, or ``None`` to keep them stacked by silo.
    :param int num_samples: number of draws.
    """
    unit_axis = {n: s.unit_axis for n, s in guide.local_specs.items()}

    num_silos = len(jax.tree.leaves(params.eta_local)[0]) if params.eta_local else 0
    if params.eta_local:
        units = guide.num_units(jax.tree.map(lambda x: x[0], params.eta_local))
        # distinct ids: unit i of every silo must not share its local noise
        ids = jnp.arange(num_silos * units).reshape(num_silos, units)
        if data is not None:
            ids = data.unit_ids

    def one(key):
        z_g, values, _ = guide.draw_global(params.eta_global, key)
        if params.eta_local:
            local, _ = jax.vmap(
                lambda eta, i: guide.draw_local(params.eta_global, eta, z_g, key, i)
            )(params.eta_local, ids)
            values.update(local)
        return values

    draws = jax.vmap(one)(jax.random.split(rng_key, num_samples))
    if data is not None:
        for name, axis in unit_axis.items():
            x = jnp.moveaxis(draws[name], axis + 2, 2)  # (S, J, P, ...)
            x = jax.vmap(data.gather_units)(x)  # (S, N, ...)
            draws[name] = jnp.moveaxis(x, 1, axis + 1)
    return draws
