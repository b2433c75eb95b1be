# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Amortized local factors (Hassan et al., §3.2 remark; spec §3.8).

The global factor is the structured Gaussian of :class:`AutoGlobalLocalNormal`; each unit's
local factor is a diagonal Gaussian whose location and scale an encoder network
computes from that unit's own data,

.. math::

    q(z_{L_{j,k}}) = N\\big(z_{L_{j,k}};\\ \\mu_\\phi(x_{j,k}),\\
    \\mathrm{diag}\\,\\sigma_\\phi(x_{j,k})^2\\big),

so a silo stores no per-unit variational parameters, only its units' encoder inputs
(which never leave it). The encoder weights :math:`\\phi` either sit with the global
parameters :math:`\\eta_G` (``shared=True``, the paper's :math:`\\phi \\in \\theta`: SFVI
sums the silos' gradients for :math:`\\phi` and equals centralized amortized VI), or
each silo keeps its own encoder in its local parameters (``shared=False``: nothing about
a silo's local posterior leaves it, which is the paper's privacy rule, and SFVI-Avg
runs unchanged).
"""

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.distributions import constraints
from numpyro.infer.initialization import init_to_uniform

from numpyro_fed.families.gaussian import gaussian_log_density
from numpyro_fed.families.structured import AutoGlobalLocalNormal

__all__ = ["AutoAmortized"]


def _inverse_softplus(x: float) -> float:
    return float(np.log(np.expm1(x)))


class AutoAmortized(AutoGlobalLocalNormal):
    """
    Structured Gaussian global factor with amortized, diagonal Gaussian local factors:
    an MLP maps each unit's features to the location and softplus scale of its local
    latents (unconstrained space, every local site of the unit together).

    The silo's features are computed once, at initialization, by ``features`` from its
    own arrays and kept in its local parameters (key ``"inputs"``, held fixed: their
    gradient is stopped, so optimizers such as Adam or SGD never move them). Used as
    an ordinary NumPyro guide, pass the data by keyword.

    :param callable model: a federated model.
    :param callable features: ``arrays -> (units, d)`` encoder inputs, one row per unit
        of the silo plate, computed from that unit's data only (e.g. normalized word
        counts).
    :param tuple hidden: widths of the encoder's hidden layers.
    :param bool shared: one encoder for all silos, in :math:`\\eta_G` (``True``), or one
        private encoder per silo, in its local parameters (``False``).
    :param callable activation: hidden-layer nonlinearity.
    :param str global_cov: ``"diag"`` or ``"full"``, as in :class:`AutoGlobalLocalNormal`.
    :param callable init_loc_fn: NumPyro init strategy for the global locations.
    :param float init_scale: initial scale of the global factor and of the local
        factors (the encoder starts at location 0 and this scale for every unit).

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp, optax
        >>> import numpyro, numpyro.distributions as dist
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 1))
        ...     with numpyro.plate("doc", y.shape[0]):
        ...         z = numpyro.sample("z", dist.Normal(mu, 1))
        ...         numpyro.sample("y", dist.Normal(z, 0.5), obs=y)
        >>> fed = nf.federate(model, silos="doc")
        >>> guide = nf.AutoAmortized(fed, features=lambda a: a["y"][:, None])
        >>> data = nf.FederatedData.from_groups([0, 0, 1, 1], y=jnp.arange(4.0))
        >>> svi = nf.SFVI(fed, guide, optax.adam(0.05))
        >>> result = svi.run(jax.random.key(0), 10, data, progress_bar=False)
        >>> sorted(result.params.eta_global), sorted(result.params.eta_local)
        (['encoder', 'loc', 'scale'], ['inputs'])
    """

    def __init__(
        self,
        model: Callable,
        *,
        features: Callable[[dict], jax.Array],
        hidden: tuple[int, ...] = (32,),
        shared: bool = True,
        activation: Callable = jax.nn.softplus,
        global_cov: str = "diag",
        init_loc_fn: Callable = init_to_uniform,
        init_scale: float = 0.1,
    ) -> None:
        if not callable(features):
            raise TypeError(f"features must be callable, got {type(features)}.")
        hidden = tuple(int(h) for h in hidden)
        if any(h < 1 for h in hidden):
            raise ValueError(f"hidden widths must be positive, got {hidden}.")
        super().__init__(
            model,
            global_cov=global_cov,
            coupling=False,
            local_cov="diag",
            init_loc_fn=init_loc_fn,
            init_scale=init_scale,
        )
        self.features = features
        self.hidden = hidden
        self.shared = bool(shared)
        self.activation = activation

    # --------------------------------------------------------------- encoder
    def _features(self, arrays: dict, kwargs: dict | None) -> jax.Array:
        inputs = jnp.asarray(self.features({**(kwargs or {}), **arrays}))
        if inputs.ndim != 2:
            raise ValueError(
                "features(arrays) must return a 2-D (units, d) array, one row per unit "
                f"of the silo plate; got shape {inputs.shape}."
            )
        return inputs

    def _layer_sizes(self, num_inputs: int) -> list[int]:
        return [num_inputs, *self.hidden, 2 * self.local_dim]

    def _init_encoder(self, key: jax.Array, num_inputs: int, dtype) -> jax.Array:
        sizes = self._layer_sizes(num_inputs)
        flat = []
        keys = jax.random.split(key, len(sizes) - 1)
        for i, (k, n_in, n_out) in enumerate(
            zip(keys, sizes[:-1], sizes[1:], strict=True)
        ):
            last = i == len(sizes) - 2
            # The last layer starts at zero weights, so every unit starts from the
            # same factor: location 0 and scale init_scale.
            w = (
                jnp.zeros((n_in, n_out), dtype)
                if last
                else jax.random.normal(k, (n_in, n_out), dtype) / np.sqrt(n_in)
            )
            b = jnp.zeros((n_out,), dtype)
            if last:
                b = b.at[self.local_dim :].set(_inverse_softplus(self.init_scale))
            flat += [w.reshape(-1), b]
        return jnp.concatenate(flat)

    def encoder_size(self, num_inputs: int) -> int:
        """Number of encoder weights for ``num_inputs`` features."""
        sizes = self._layer_sizes(num_inputs)
        return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=True))

    def encode(self, encoder: jax.Array, inputs: jax.Array):
        """Per-unit location and scale ``(units, n_L)`` of the local factors.

        :param jax.Array encoder: the flat encoder weights.
        :param jax.Array inputs: ``(units, d)`` features.
        """
        sizes = self._layer_sizes(inputs.shape[-1])
        if encoder.shape != (self.encoder_size(inputs.shape[-1]),):
            raise ValueError(
                f"The encoder has {encoder.shape} weights but {inputs.shape[-1]} "
                f"features need {self.encoder_size(inputs.shape[-1])}."
            )
        h, start = inputs, 0
        for i, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            w = encoder[start : start + n_in * n_out].reshape(n_in, n_out)
            start += n_in * n_out
            b = encoder[start : start + n_out]
            start += n_out
            h = h @ w + b
            if i < len(sizes) - 2:
                h = self.activation(h)
        n = self.local_dim
        return h[:, :n], jax.nn.softplus(h[:, n:])

    def _encoder_of(self, eta_g: dict, eta_l: dict) -> jax.Array:
        return eta_g["encoder"] if self.shared else eta_l["encoder"]

    # ------------------------------------------------------------ parameters
    def param_constraints(self) -> tuple[dict, dict]:
        """Constraints of the global and local parameter dicts."""
        glob, _ = super().param_constraints()
        if self.local_dim == 0:
            raise ValueError(
                "AutoAmortized needs local latent sites inside the silo plate; this "
                "model has none (use AutoGlobalLocalNormal)."
            )
        if self.shared and not glob:
            raise NotImplementedError(
                "A shared encoder lives with the global parameters, and this model "
                "has no global latent site; use shared=False."
            )
        loc = {"inputs": constraints.real}
        if self.shared:
            glob = {**glob, "encoder": constraints.real}
        else:
            loc["encoder"] = constraints.real
        return glob, loc

    def init_global(self, key: jax.Array, template: dict, args=(), kwargs=None) -> dict:
        """Initial (constrained) :math:`\\eta_G`, with the encoder when shared."""
        eta = super().init_global(key, template, args, kwargs)
        if self.shared:
            inputs = self._features(template, kwargs)
            eta["encoder"] = self._init_encoder(
                jax.random.fold_in(key, 17), inputs.shape[-1], eta["loc"].dtype
            )
        return eta

    def init_local(self, key: jax.Array, arrays: dict, args=(), kwargs=None) -> dict:
        """The silo's encoder inputs (and its private encoder when not shared)."""
        self.require_setup()
        inputs = self._features(arrays, kwargs)
        eta = {"inputs": inputs}
        if not self.shared:
            # Every silo starts from the same encoder; the key is not used, so that
            # private encoders are identical to a shared one at initialization.
            eta["encoder"] = self._init_encoder(
                jax.random.fold_in(jax.random.key(0), 17),
                inputs.shape[-1],
                inputs.dtype,
            )
        return eta

    @property
    def units_separable(self) -> bool:
        """``False``: a private encoder is one silo's, not one unit's."""
        return self.shared

    # ------------------------------------------------------ sampling, density
    def _loc_scale(self, eta_g: dict, eta_l: dict):
        inputs = jax.lax.stop_gradient(eta_l["inputs"])
        return self.encode(self._encoder_of(eta_g, eta_l), inputs)

    def sample_local(self, eta_g, eta_l, z_g, eps) -> jax.Array:
        """:math:`z_L = \\mu_\\phi(x) + \\sigma_\\phi(x) \\odot \\epsilon_L`, one row per
        unit (independent of :math:`z_G`)."""
        del z_g
        loc, scale = self._loc_scale(eta_g, eta_l)
        return loc + scale * eps

    def log_q_local(self, eta_g, eta_l, z_g, z_l, mask=None) -> jax.Array:
        """Per-unit :math:`\\log q(z_L)`, shape ``(units,)``, over the coordinates
        where ``mask`` is True."""
        del z_g
        loc, scale = self._loc_scale(eta_g, eta_l)
        return gaussian_log_density(z_l, loc, scale, None, mask)

    def local_marginal(self, eta_g: dict, eta_l: dict) -> tuple[jax.Array, jax.Array]:
        """The encoder's location and scale ``(units, n_L)`` of each unit's
        unconstrained local coordinates (independent of :math:`z_G`)."""
        return self._loc_scale(eta_g, eta_l)

    def num_units(self, eta_l: dict) -> int:
        """Units held by one silo: its stored encoder inputs."""
        return eta_l["inputs"].shape[0]
