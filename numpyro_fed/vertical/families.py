# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Variational families for vertically split models (Hassan et al. seed 003, §4).

Per party :math:`j`: a Gaussian :math:`q(\\theta_j)` over the flattened
unconstrained latents of its block (full or diagonal covariance), and for its
auxiliary either

* ``aux="meanfield"``: :math:`q(z_j) = \\mathcal N(\\mu_{z_j}, \\sigma_{z_j})`, free per
  row (:math:`2n` parameters), or
* ``aux="amortized"``: :math:`q(z_j \\mid \\theta_j) = \\mathcal N(u + \\rho\\, m_\\psi,\\
  \\rho\\, \\mathrm{softplus}(s_\\psi + \\mathrm{softplus}^{-1}(1)))` with
  :math:`u = g_j(x_j, \\theta_j)` and :math:`(m_\\psi, s_\\psi)` a small MLP of
  :math:`u` (and :math:`y` under the power likelihood) applied row by row, so its size
  does not grow with :math:`n`. The last layer starts at zero: :math:`q = p(z\\mid
  \\theta)` at initialization (the residual head of the spec, §3).

The server holds a Gaussian :math:`q(\\gamma)` over its own latents (intercept, noise
scale). Parameters are plain dicts per owner; ``numpyro.param`` sites of the model are
point-estimated by their owner.
"""

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import numpyro.distributions as dist
from numpyro.distributions import biject_to

from numpyro_fed.densities import constrain_site
from numpyro_fed.vertical.structure import SERVER, VerticalStructure

__all__ = ["VerticalFamily"]

_SOFTPLUS_INV_1 = float(np.log(np.expm1(1.0)))


def _softplus_inv(x: Any) -> jax.Array:
    return jnp.log(jnp.expm1(x))


class VerticalFamily:
    """
    The variational family of vertical federated VI: one independent block per owner.

    :param str aux: ``"amortized"`` or ``"meanfield"`` for the auxiliaries.
    :param str theta_cov: ``"full"`` or ``"diag"`` covariance of each :math:`q(\\theta_j)`
        and of :math:`q(\\gamma)`.
    :param tuple hidden: hidden widths of the amortization MLP (tanh).
    :param float init_scale: initial standard deviation of :math:`q(\\theta_j)`.

    **Example:**

    .. doctest::

        >>> import numpyro_fed as nf
        >>> nf.VerticalFamily(aux="meanfield", theta_cov="diag").aux
        'meanfield'
    """

    def __init__(
        self,
        aux: str = "amortized",
        theta_cov: str = "full",
        hidden: tuple = (16, 16),
        init_scale: float = 0.1,
    ) -> None:
        if aux not in ("amortized", "meanfield"):
            raise ValueError(f"aux must be 'amortized' or 'meanfield', got {aux!r}.")
        if theta_cov not in ("full", "diag"):
            raise ValueError(f"theta_cov must be 'full' or 'diag', got {theta_cov!r}.")
        if not init_scale > 0:
            raise ValueError(f"init_scale must be positive, got {init_scale!r}.")
        hidden = tuple(int(h) for h in hidden)
        if any(h < 1 for h in hidden):
            raise ValueError(f"hidden widths must be positive, got {hidden!r}.")
        self.aux = aux
        self.theta_cov = theta_cov
        self.hidden = hidden
        self.init_scale = float(init_scale)
        self.structure: VerticalStructure | None = None
        self.rho: dict = {}

    def setup(self, structure: VerticalStructure, rho: dict) -> None:
        """Bind the family to a model's structure and per-party :math:`\\rho_j`."""
        self.structure = structure
        self.rho = dict(rho)

    @property
    def _bound(self) -> VerticalStructure:
        """The structure :meth:`setup` bound (an error before it)."""
        if self.structure is None:
            raise RuntimeError("VerticalFamily has no model structure yet: call setup first.")
        return self.structure

    # ------------------------------------------------------------------ sizes
    def _sites(self, owner: str) -> list:
        return sorted(self._bound.latents[owner].items())

    def dim(self, owner: str) -> int:
        """Size of the owner's flattened unconstrained latent vector."""
        return sum(int(np.prod(s.unconstrained_shape)) for _, s in self._sites(owner))

    def num_inputs(self) -> int:
        """Inputs of the amortization network per row: :math:`u` (and :math:`y`)."""
        return 2 if self._bound.kind == "power" else 1

    # ------------------------------------------------------------------- init
    def init(self, owner: str, key: jax.Array, u: jax.Array | None = None) -> dict:
        """Raw (unconstrained) parameters of one owner's block.

        :param str owner: a party or ``"server"``.
        :param jax.random.key key: for the network's weights.
        :param u: the party's contribution at the initial :math:`\\theta_j`: the
            initial mean of a mean-field :math:`q(z_j)`.
        """
        d = self.dim(owner)
        raw: dict = {}
        if d:
            raw["loc"] = jnp.zeros(d)
            # a strong dtype (not a Python float's weak one): a round that returns
            # it strongly typed would otherwise compile a second time
            raw["scale"] = jnp.full((d,), _softplus_inv(self.init_scale), float)
            if self.theta_cov == "full":
                raw["tril"] = jnp.zeros((d, d))
        raw["param"] = {
            name: biject_to(spec.constraint).inv(spec.init)
            for name, spec in self._bound.params[owner].items()
        }
        if owner == SERVER:
            return raw
        rho = self.rho[owner]
        if self.aux == "meanfield":
            rows, shape = self._z_full_shape(owner)
            base = jnp.zeros(shape) if u is None else jnp.broadcast_to(u, shape)
            raw["z_loc"] = base
            raw["z_scale"] = jnp.full(shape, _softplus_inv(rho), float)
        else:
            sizes = (self.num_inputs(),) + self.hidden + (2,)
            keys = jax.random.split(key, len(sizes) - 1)
            net = []
            for i, (k, a, b) in enumerate(
                zip(keys, sizes[:-1], sizes[1:], strict=True)
            ):
                last = i == len(sizes) - 2
                w = jnp.zeros((a, b)) if last else jax.random.normal(k, (a, b)) / a**0.5
                net.append({"W": w, "b": jnp.zeros(b)})
            raw["net"] = net
        return raw

    def _z_full_shape(self, party: str) -> tuple[int, tuple]:
        shape = self._bound.z_shape[party]
        rows = self._bound.rows
        n = rows[1] if rows is not None else shape[0]
        return n, (n,) + tuple(shape[1:])

    # ------------------------------------------------------------ constrained
    def constrain(self, owner: str, raw: dict) -> dict:
        """Constrained parameters: ``loc`` and ``scale_tril`` (full) or ``scale``
        (diag) of :math:`q(\\theta_j)`; ``z_loc``/``z_scale`` or ``net``; ``param``."""
        out: dict = {}
        if "loc" in raw:
            out["loc"] = raw["loc"]
            scale = jax.nn.softplus(raw["scale"])
            if "tril" in raw:
                out["scale_tril"] = jnp.tril(raw["tril"], -1) + jnp.diag(scale)
            else:
                out["scale"] = scale
        out["param"] = {
            name: biject_to(self._bound.params[owner][name].constraint)(v)
            for name, v in raw["param"].items()
        }
        if "z_loc" in raw:
            out["z_loc"] = raw["z_loc"]
            out["z_scale"] = jax.nn.softplus(raw["z_scale"])
        if "net" in raw:
            out["net"] = raw["net"]
        return out

    def theta_dist(self, p: dict) -> dist.Distribution:
        """:math:`q` of the flattened unconstrained latents (constrained params)."""
        if "scale_tril" in p:
            return dist.MultivariateNormal(p["loc"], scale_tril=p["scale_tril"])
        return dist.Normal(p["loc"], p["scale"]).to_event(1)

    def draw_flat(self, p: dict, eps: jax.Array) -> jax.Array:
        """The reparameterized draw :math:`\\mu + L\\epsilon`."""
        if "scale_tril" in p:
            return p["loc"] + p["scale_tril"] @ eps
        return p["loc"] + p["scale"] * eps

    def unpack(self, owner: str, flat: jax.Array) -> tuple[dict, jax.Array]:
        """Site values (constrained) of a flat unconstrained vector, and
        :math:`\\log|\\det J|` of the constraining map."""
        values, log_det, start = {}, jnp.zeros(()), 0
        for name, spec in self._sites(owner):
            size = int(np.prod(spec.unconstrained_shape))
            x = flat[start : start + size].reshape(spec.unconstrained_shape)
            start += size
            values[name], ld = constrain_site(spec.support, x)
            log_det = log_det + jnp.sum(ld)
        return values, log_det

    def draw_latents(
        self, owner: str, p: dict, p_q: dict, eps: jax.Array
    ) -> tuple[dict, jax.Array]:
        """Draw the owner's latents with noise ``eps``; returns ``(values, log q)``,
        ``log q`` evaluated with the parameters ``p_q`` (stop-gradient ones for STL)."""
        if "loc" not in p:
            return {}, jnp.zeros(())
        flat = self.draw_flat(p, eps)
        values, log_det = self.unpack(owner, flat)
        return values, self.theta_dist(p_q).log_prob(flat) - log_det

    def z_dist(
        self,
        party: str,
        p: dict,
        u: jax.Array,
        y: jax.Array | None = None,
        idx: jax.Array | None = None,
    ) -> dist.Normal:
        """:math:`q(z_j\\mid\\theta_j)` (or :math:`q(z_j)`) on this round's rows, as a
        ``Normal`` of :math:`z_j`'s shape (batch, not event, dims)."""
        if "z_loc" in p:
            loc, scale = p["z_loc"], p["z_scale"]
            if idx is not None:
                loc, scale = loc[idx], scale[idx]
            return dist.Normal(loc, scale)
        rho = self.rho[party]
        feats = [u]
        if self.num_inputs() == 2:
            if y is None:
                raise ValueError("The power-likelihood network needs the labels y.")
            y = jnp.asarray(y, u.dtype)
            feats.append(
                jnp.broadcast_to(y.reshape(y.shape + (1,) * (u.ndim - y.ndim)), u.shape)
            )
        h = jnp.stack(feats, -1)
        for layer in p["net"][:-1]:
            h = jnp.tanh(h @ layer["W"] + layer["b"])
        out = h @ p["net"][-1]["W"] + p["net"][-1]["b"]
        loc = u + rho * out[..., 0]
        scale = rho * jax.nn.softplus(out[..., 1] + _SOFTPLUS_INV_1)
        return dist.Normal(loc, scale)
