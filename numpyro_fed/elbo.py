# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""The ELBO's per-silo and server terms for a structured family, written once.

For one draw of the global latents :math:`z_G \\sim q_{\\eta_G}` the ELBO splits as

.. math::

    \\underbrace{\\log p_\\theta(z_G) - \\log q_{\\eta_G}(z_G)}_{\\text{server}}
    + \\sum_j \\underbrace{\\log p_\\theta(y_j, z_{L_j} \\mid z_G)
    - \\log q_{\\eta_{L_j}}(z_{L_j} \\mid z_G)}_{\\text{silo } j}

(Hassan et al., Supplement S1, eqs. S4-S8). SFVI sends the gradients of the silo
terms, SFVI-Avg scales them by :math:`N/N_j`, PVI's local free energy uses the silo
term against a cavity: all read them from here.
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from numpyro_fed.densities import server_log_density, silo_log_density
from numpyro_fed.protocol import SiloData
from numpyro_fed.util import flat_barrier, unconstrain

__all__ = [
    "GlobalDraw",
    "SiloTerms",
    "draw_global",
    "initial_globals",
    "noise_keys",
    "server_terms",
    "silo_terms",
]


class GlobalDraw(NamedTuple):
    """- **z** - the unconstrained global vector :math:`z_G` (``(0,)`` if none).
    - **values** - the global sites' constrained values, by name.
    - **log_det** - :math:`\\log |\\det J|` of the constraining map at ``z``.
    """

    z: jax.Array
    values: dict
    log_det: jax.Array


class SiloTerms(NamedTuple):
    """- **log_p** - :math:`\\log p_\\theta(y_j, z_{L_j} \\mid z_G)` (padding masked).
    - **log_q** - :math:`\\log q(z_{L_j} \\mid z_G)` in the constrained space, summed
      over the silo's real units (0 without local latents).
    """

    log_p: jax.Array
    log_q: jax.Array


def draw_global(guide: Any, eta_global: dict, noise: jax.Array) -> GlobalDraw:
    """:math:`z_G` from the constrained global parameters and standard noise."""
    if not eta_global:
        return GlobalDraw(jnp.zeros((0,)), {}, jnp.zeros(()))
    z = guide.sample_global(eta_global, noise)
    values, log_det = guide.constrain_global(z)
    return GlobalDraw(z, values, log_det)


def silo_terms(
    model: Callable,
    guide: Any,
    draw: GlobalDraw,
    theta: dict,
    eta_global: dict,
    eta_local: dict,
    key: jax.Array,
    data: SiloData,
    *,
    stop: Callable = lambda x: x,
    padded: bool = True,
    observed_fn: Callable | None = None,
    noise: jax.Array | None = None,
) -> SiloTerms:
    """One silo's terms at one global draw; its local latents are drawn here from
    the silo's own ``key`` (and its units' pooled ids, so any partition of units
    into silos draws the same noise).

    :param draw: the global draw (:func:`draw_global`).
    :param dict theta: constrained model parameters.
    :param dict eta_global: constrained global variational parameters.
    :param dict eta_local: constrained local variational parameters (may be empty).
    :param key: the silo's key for its local noise.
    :param SiloData data: the silo's own data.
    :param callable stop: applied to the variational parameters inside
        :math:`\\log q` (``jax.lax.stop_gradient``: sticking the landing).
    :param bool padded: mask padded units out.
    :param callable observed_fn: a robust loss on each observation's log-likelihood.
    :param jax.Array noise: the units' local noise, if already drawn (``key`` is
        then unused).
    """
    values = dict(draw.values)
    log_q = jnp.zeros(())
    if eta_local:
        # Padded entries of ragged nested plates: left out of log q and unable to
        # condition the real ones, as the model's mask leaves them out of log p.
        mask = guide.local_mask(data.nested, data.unit_ids.shape[0])
        eta_local = guide.restrict_local(eta_local, mask)
        # Barriers: XLA's CPU fusion would otherwise recompute the per-unit normal
        # draws (an inverse-erf polynomial) and the local sample inside each
        # consumer, once per entry of the nested plates they are broadcast over;
        # materialized once, a round costs up to 40 % less (identity on values).
        if noise is None:
            noise = guide.local_noise(key, data.unit_ids)
        noise = flat_barrier(noise)
        z_local = flat_barrier(guide.sample_local(eta_global, eta_local, draw.z, noise))
        local_values, log_det = guide.constrain_local(z_local, mask)
        values.update(local_values)
        units = guide.log_q_local(
            stop(eta_global), stop(eta_local), draw.z, z_local, mask
        )
        units = units - log_det
        if padded:
            units = jnp.where(data.mask, units, 0.0)
        log_q = jnp.sum(units)
    plate = guide.roles.silo_plate
    mask = data.mask if padded else None
    log_p = silo_log_density(
        model,
        plate,
        data.arrays,
        mask,
        {**values, **theta},
        observed_fn=observed_fn,
        nested=data.nested,
    )
    return SiloTerms(log_p, log_q)


def server_terms(
    model: Callable,
    guide: Any,
    template: dict,
    draw: GlobalDraw,
    theta: dict,
    eta_global: dict,
    *,
    stop: Callable = lambda x: x,
) -> tuple[jax.Array, jax.Array]:
    """``(log p(z_G), log q(z_G))``: the server's terms at one global draw, the model
    run on ``template``, one unit of silo data."""
    log_q = jnp.zeros(())
    if eta_global:
        log_q = guide.log_q_global(stop(eta_global), draw.z) - draw.log_det
    plate = guide.roles.silo_plate
    log_p = server_log_density(model, plate, template, {**draw.values, **theta})
    return log_p, log_q


def initial_globals(guide: Any, key: jax.Array, template: dict) -> tuple[dict, dict]:
    """Unconstrained initial theta (the model's own param inits) and eta_G."""
    inits = {k: jnp.asarray(v) for k, (v, _) in guide.param_specs.items()}
    theta = unconstrain(guide.theta_constraints(), inits)
    eta_global = guide.init_global(key, template)
    return theta, unconstrain(guide.param_constraints()[0], eta_global)


def noise_keys(step_key: jax.Array, num_particles: int) -> jax.Array:
    """The guide noise keys NumPyro's ``Trace_ELBO`` would give this step.

    ``SVI.update`` passes ``step_key`` to the ELBO, which splits it into one key per
    particle (only when ``num_particles > 1``), then into ``(model_seed,
    guide_seed)``; the guide's first keyed primitive, :func:`numpyro.prng_key`, takes
    ``split(guide_seed)[1]`` from the seed handler. Reproducing that chain makes a
    simulated SFVI run equal centralized NumPyro SVI draw for draw.
    """
    keys = (
        step_key[None]
        if num_particles == 1
        else jax.random.split(step_key, num_particles)
    )

    def guide_noise_key(key):
        _, guide_seed = jax.random.split(key)
        return jax.random.split(guide_seed)[1]

    return jax.vmap(guide_noise_key)(keys)
