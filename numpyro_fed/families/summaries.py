# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""What NumPyro's ``AutoGuide`` offers after a fit (``sample_posterior``,
``median``, ``quantiles``, ``get_posterior``), for the global-local families.

Every family here is Gaussian in the unconstrained space: :math:`z_G` and each unit's
:math:`z_{L_u}` are affine in standard normal noise with a lower-triangular map, so
the joint is a :class:`~numpyro.distributions.MultivariateNormal` whose
``scale_tril`` is that map, and each coordinate's marginal is a Normal.

Parameters come in two layouts:

- **pooled** (a dict, NumPyro's): what ``SVI(model, guide, ...).get_params(state)``
  returns, or ``nf.SFVI(...).pooled_params(result.params, data)``; local parameters
  are one row per unit of the model's silo plate, and local sites come back in the
  model's shapes.
- **stacked** (a :class:`~numpyro_fed.infer.vi.SFVIParams` or
  :class:`~numpyro_fed.infer.pvi.PVIParams`, what a federated fit returns): local
  parameters are stacked ``(J, P, ...)`` by silo, and local sites come back with a
  leading silo axis, padded units included (``data.gather_units`` of a
  :class:`~numpyro_fed.FederatedData` turns one into the pooled layout). A deployed
  server's parameters (no local part) give the global sites only.
"""

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.scipy.special import ndtri
import numpy as np
import numpyro.distributions as dist

from numpyro_fed.families.gaussian import cholesky_factor

if TYPE_CHECKING:
    from numpyro_fed.families.structured import AutoGlobalLocalNormal

__all__ = [
    "global_marginal",
    "joint_posterior",
    "median",
    "quantiles",
    "sample_posterior",
    "split_params",
]

_WHAT_TO_PASS = (
    "pass this guide's NumPyro parameters (svi.get_params(state) of "
    "numpyro.infer.SVI, or result.params of SVI.run) or a numpyro_fed fit's "
    "parameters (result.params or svi.get_params(state) of nf.SFVI, nf.SFVIAvg, "
    "nf.PVI)"
)


def split_params(
    guide: "AutoGlobalLocalNormal", params: Any
) -> tuple[dict, dict, bool]:
    """``(eta_global, eta_local, stacked)`` of ``params`` in either layout (module
    docstring); ``stacked`` is True for a federated fit's parameters.

    :raises ValueError: naming the parameters that are missing.
    :raises TypeError: for anything else.
    """
    # The names' home is the guide's module, which imports this one.
    from numpyro_fed.families.structured import GLOBAL_PREFIX, LOCAL_PREFIX

    guide.require_setup()
    glob_c, loc_c = guide.param_constraints()
    if isinstance(params, Mapping):
        names = [GLOBAL_PREFIX + k for k in glob_c] + [LOCAL_PREFIX + k for k in loc_c]
        missing = [n for n in names if n not in params]
        if missing:
            raise ValueError(
                f"params lacks this guide's parameters {missing}: {_WHAT_TO_PASS}."
            )
        eta_g = {k: params[GLOBAL_PREFIX + k] for k in glob_c}
        return eta_g, {k: params[LOCAL_PREFIX + k] for k in loc_c}, False
    if hasattr(params, "eta_global") and hasattr(params, "eta_local"):
        eta_g, eta_l = dict(params.eta_global), dict(params.eta_local)
        missing = sorted(set(glob_c) - set(eta_g))
        if eta_l:  # empty: a deployed server's view, which holds no local part
            missing += sorted(f"eta_local[{k!r}]" for k in set(loc_c) - set(eta_l))
        if missing:
            raise ValueError(
                f"params lacks this guide's parameters {missing}: {_WHAT_TO_PASS}."
            )
        return eta_g, eta_l, True
    raise TypeError(
        f"params must be a dict or an SFVIParams; got {type(params).__name__}: "
        f"{_WHAT_TO_PASS}."
    )


def global_marginal(eta_g: dict) -> tuple[jax.Array, jax.Array]:
    """Mean and standard deviation of each unconstrained global coordinate."""
    factor = cholesky_factor(eta_g["scale"], eta_g.get("tril"))
    return eta_g["loc"], jnp.sqrt(jnp.sum(factor**2, -1))


def _over_silos(fn, eta_l: dict, stacked: bool) -> dict:
    return jax.vmap(fn)(eta_l) if stacked else fn(eta_l)


def median(guide: "AutoGlobalLocalNormal", params: Any) -> dict[str, jax.Array]:
    """Each latent site at the unconstrained location of its marginal, constrained
    (the marginal median for elementwise monotone supports)."""
    eta_g, eta_l, stacked = split_params(guide, params)
    values = guide.constrain_global(eta_g["loc"])[0] if eta_g else {}
    if eta_l:

        def local(eta):
            return guide.constrain_local(guide.local_marginal(eta_g, eta)[0])[0]

        values.update(_over_silos(local, eta_l, stacked))
    return values


def quantiles(
    guide: "AutoGlobalLocalNormal", params: Any, quantiles: Sequence[float] | jax.Array
) -> dict[str, jax.Array]:
    """The quantiles of each unconstrained coordinate's Normal marginal, constrained;
    a leading axis of ``len(quantiles)`` (as NumPyro's ``AutoNormal``)."""
    eta_g, eta_l, stacked = split_params(guide, params)
    leaves = jax.tree.leaves((eta_g, eta_l))
    dtype = leaves[0].dtype if leaves else jnp.result_type(float)
    q = jnp.asarray(quantiles, dtype).reshape(-1)
    if not bool(jnp.all((q > 0) & (q < 1))):
        raise ValueError(f"quantiles must lie in (0, 1); got {quantiles!r}.")
    normal = ndtri(q)
    values: dict = {}
    if eta_g:
        loc, sd = global_marginal(eta_g)
        z = loc + sd * normal[:, None]
        values.update(jax.vmap(lambda u: guide.constrain_global(u)[0])(z))
    if eta_l:

        def local(eta):
            loc, sd = guide.local_marginal(eta_g, eta)
            z = loc + sd * normal[:, None, None]
            return jax.vmap(lambda u: guide.constrain_local(u)[0])(z)

        out = _over_silos(local, eta_l, stacked)
        if stacked:  # (J, Q, ...) -> (Q, J, ...)
            out = {k: jnp.moveaxis(v, 1, 0) for k, v in out.items()}
        values.update(out)
    return values


def sample_posterior(
    guide: "AutoGlobalLocalNormal",
    rng_key: jax.Array,
    params: Any,
    sample_shape: tuple[int, ...] = (),
) -> dict[str, jax.Array]:
    """Joint draws of every latent site, with a leading ``sample_shape``."""
    eta_g, eta_l, stacked = split_params(guide, params)
    sample_shape = tuple(int(s) for s in sample_shape)
    num = int(np.prod(sample_shape))

    def one(key):
        z_g, values, _ = guide.draw_global(eta_g, key)
        if not eta_l:
            return values
        if stacked:
            # Distinct unit ids across silos: units of different silos are
            # conditionally independent given z_G, so they need their own noise.
            num_silos = len(jax.tree.leaves(eta_l)[0])
            units = guide.num_units(jax.tree.map(lambda x: x[0], eta_l))
            ids = jnp.arange(num_silos * units).reshape(num_silos, units)
            local = jax.vmap(
                lambda eta, i: guide.draw_local(eta_g, eta, z_g, key, i)[0]
            )(eta_l, ids)
        else:
            ids = jnp.arange(guide.num_units(eta_l))
            local = guide.draw_local(eta_g, eta_l, z_g, key, ids)[0]
        return {**values, **local}

    draws = jax.vmap(one)(jax.random.split(rng_key, num))
    return {k: v.reshape(sample_shape + v.shape[1:]) for k, v in draws.items()}


def joint_posterior(
    guide: "AutoGlobalLocalNormal", params: Any
) -> dist.MultivariateNormal:
    """The joint Gaussian of the unconstrained latent vector
    :math:`(z_G, z_{L_1}, \\dots, z_{L_U})`, local coordinates unit by unit."""
    eta_g, eta_l, stacked = split_params(guide, params)
    if stacked and eta_l:
        raise ValueError(
            "get_posterior needs the pooled layout, one row per unit of the model's "
            "silo plate (stacked silos hold padded units that are not the model's): "
            "pass svi.pooled_params(result.params, data), or a deployed server's "
            "parameters without the local part for the global block only."
        )
    n_g = guide.global_dim if eta_g else 0
    units = guide.num_units(eta_l) if eta_l else 0
    n_l = guide.local_dim

    def draw(eps):
        z_g = eps[:n_g]
        if eta_g:
            z_g = guide.sample_global(eta_g, z_g)
        if not eta_l:
            return z_g
        eps_l = eps[n_g:].reshape(units, n_l)
        z_l = guide.sample_local(eta_g, eta_l, z_g, eps_l)
        return jnp.concatenate([z_g, z_l.reshape(-1)])

    dtype = jax.tree.leaves((eta_g, eta_l))[0].dtype
    zero = jnp.zeros(n_g + units * n_l, dtype)
    # The draw is affine in the noise with a lower-triangular map (each coordinate
    # reads noise of earlier coordinates only), so its Jacobian is the joint's
    # Cholesky factor, exactly.
    return dist.MultivariateNormal(draw(zero), scale_tril=jax.jacfwd(draw)(zero))
