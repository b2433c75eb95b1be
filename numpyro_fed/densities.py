# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Per-silo log-density terms and the server term, from the ordinary model.

Each silo evaluates the *ordinary model on its own arrays* with the global sites
supplied; its term sums the log-probabilities of the sites inside the silo plate:

.. math::

    \\log p_\\theta(y_j, z_{L_j} \\mid z_G).

The server term is :math:`\\log p_\\theta(z_G)`, the sites outside the plate. Their
sum is the pooled log joint (Hassan et al., Supplement S1).
"""

from typing import Any, Callable

import jax
import jax.numpy as jnp
from numpyro import handlers
from numpyro.distributions import biject_to
from numpyro.primitives import Messenger

from numpyro_fed.partition import SiteSpec

__all__ = [
    "constrain_site",
    "data_template",
    "real_entries",
    "server_log_density",
    "silo_log_density",
    "silo_mask",
    "site_log_prob",
    "sum_log_probs",
]


class silo_mask(Messenger):
    """
    Mask the sites of the silo plate at padded units and at padded entries of ragged
    nested plates, so that a padded silo contributes exactly what its real entries
    contribute.

    :param callable fn: the model.
    :param str plate: name of the silo plate.
    :param jax.Array mask: boolean array of shape ``(P,)``, True for real units, or
        ``None`` (no padded units).
    :param dict nested: plate name -> the silo's real size of that nested plate.
    """

    def __init__(
        self,
        fn: Callable | None,
        plate: str,
        mask: jax.Array | None,
        nested: dict | None = None,
    ) -> None:
        self.plate = plate
        self.mask = mask
        self.nested = nested or {}
        super().__init__(fn)

    def process_message(self, msg: dict) -> None:
        if msg["type"] != "sample" or not _in_plate(msg, self.plate):
            return
        mask: bool | jax.Array = True
        for frame in msg["cond_indep_stack"]:
            trailing = (1,) * (-frame.dim - 1)
            if frame.name == self.plate and self.mask is not None:
                mask = mask & self.mask.reshape(self.mask.shape + trailing)
            elif frame.name in self.nested:
                real = jnp.arange(frame.size) < self.nested[frame.name]
                mask = mask & real.reshape(real.shape + trailing)
        if mask is not True:
            msg["fn"] = msg["fn"].mask(mask)


def _in_plate(site: dict, plate: str) -> bool:
    return any(frame.name == plate for frame in site["cond_indep_stack"])


def site_log_prob(site: dict, observed_fn: Callable | None = None) -> jax.Array:
    """
    A traced sample site's summed log density, with its mask and scale (as in
    ``numpyro.infer.util.log_density``).

    :param dict site: a ``sample`` site of a trace.
    :param callable observed_fn: optional ``(site, log_prob) -> value`` applied to
        an observed site's elementwise log-likelihood before the scale and the sum.
    """
    value, fn = site["value"], site["fn"]
    if site.get("intermediates"):
        log_prob = fn.log_prob(value, site["intermediates"])
    else:
        log_prob = fn.log_prob(value)
    if observed_fn is not None and site["is_observed"]:
        log_prob = observed_fn(site, log_prob)
    if site.get("scale") is not None:
        log_prob = site["scale"] * log_prob
    return jnp.sum(log_prob)


def sum_log_probs(
    trace: dict, keep: Callable[[dict], bool], observed_fn: Callable | None = None
) -> jax.Array:
    """
    The summed :func:`site_log_prob` of the sample sites of ``trace`` that ``keep``
    selects: a silo's sites, the server's, or a vertical owner's.

    :param dict trace: a model's trace (values substituted).
    :param callable keep: ``site -> bool``.
    :param callable observed_fn: as in :func:`site_log_prob`.
    :return: a scalar.
    """
    total = jnp.zeros(())
    for site in trace.values():
        if site["type"] == "sample" and keep(site):
            total = total + site_log_prob(site, observed_fn)
    return total


def silo_log_density(
    model: Callable,
    plate: str,
    arrays: dict,
    mask: jax.Array | None,
    values: dict,
    args: tuple = (),
    kwargs: dict | None = None,
    observed_fn: Callable | None = None,
    nested: dict | None = None,
) -> jax.Array:
    """
    One silo's term :math:`\\log p_\\theta(y_j, z_{L_j} \\mid z_G)`.

    :param callable model: the federated model.
    :param str plate: the silo plate's name.
    :param dict arrays: the silo's (padded) arrays in the model's layout.
    :param jax.Array mask: ``(P,)`` booleans, True for the silo's real units, or
        ``None`` when the silo has no padding.
    :param dict values: constrained values of every latent site (global and local)
        and of the model's param sites.
    :param callable observed_fn: optional ``(site, log_prob) -> value`` applied to the
        elementwise log-likelihood of each observed site before summing (a robust
        loss in place of the log-likelihood, for generalized VI).
    :param dict nested: plate name -> the silo's real size of each ragged nested
        plate (:attr:`~numpyro_fed.protocol.SiloData.nested`); entries beyond it are
        masked out.
    :return: a scalar.
    """
    masked = handlers.substitute(model, data=values)
    if mask is not None or nested:
        masked = silo_mask(masked, plate, mask, nested)
    trace = handlers.trace(masked).get_trace(*args, **(kwargs or {}), **arrays)
    return sum_log_probs(trace, lambda site: _in_plate(site, plate), observed_fn)


def server_log_density(
    model: Callable,
    plate: str,
    template: dict,
    values: dict,
    args: tuple = (),
    kwargs: dict | None = None,
) -> jax.Array:
    """
    The server term :math:`\\log p_\\theta(z_G)`: the sites outside the silo plate.

    The model runs on ``template`` (:func:`data_template`): only the sites outside
    the silo plate are summed, so the value is the same whichever unit it holds.

    :param callable model: the federated model.
    :param str plate: the silo plate's name.
    :param dict template: one unit of silo data in the model's layout.
    :param dict values: constrained values of the global sites and param sites.
    :return: a scalar.
    """
    # Local sites are drawn from their prior (values unused); the key is fixed.
    model = handlers.seed(handlers.substitute(model, data=values), jax.random.key(0))
    trace = handlers.trace(model).get_trace(*args, **(kwargs or {}), **template)
    return sum_log_probs(trace, lambda site: not _in_plate(site, plate))


def real_entries(
    spec: SiteSpec,
    shape: tuple,
    mask: jax.Array | None = None,
    nested: dict | None = None,
) -> jax.Array | None:
    """
    Booleans of ``shape``, a local site's value on one silo (constrained or not: the
    batch axes are the same) with its units on ``spec.unit_axis``: False at padded
    units and at padded entries of ragged nested plates, the entries that
    :class:`silo_mask` leaves out of the site's log density.

    :param SiteSpec spec: the site (:func:`~numpyro_fed.partition.site_specs`).
    :param tuple shape: the value's shape.
    :param jax.Array mask: ``(shape[unit_axis],)`` booleans, True for real units, or
        ``None``.
    :param dict nested: plate name -> the silo's real size of each ragged nested
        plate, or ``None``.
    :return: the booleans, or ``None`` when nothing is padded.
    """
    parts: list[tuple[int, jax.Array]] = []
    if mask is not None:
        parts.append((spec.local_axis, mask))
    for plate, axis in spec.plates:
        if nested and plate in nested:
            parts.append((axis, jnp.arange(shape[axis]) < nested[plate]))
    if not parts:
        return None
    keep = jnp.ones(shape, bool)
    for axis, real in parts:
        keep = keep & real.reshape(real.shape + (1,) * (len(shape) - axis - 1))
    return keep


def constrain_site(
    support: Any, u: jax.Array, keep: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """
    A site's constrained value ``biject_to(support)(u)`` and the log-Jacobian of the
    map, :math:`\\log|\\det J|` over the value's batch axes: the term that makes a
    density in the constrained space one in the unconstrained space.

    :param support: the site's support constraint.
    :param jax.Array u: the unconstrained value.
    :param jax.Array keep: booleans of ``u``'s shape (:func:`real_entries`); the
        log-Jacobian is zero where they are False. Nested plates are batch axes, so
        an event is real or padded as a whole.
    :return: ``(value, log_det)``.
    """
    transform = biject_to(support)
    value = transform(u)
    log_det = transform.log_abs_det_jacobian(u, value)
    if keep is not None:
        keep = keep.reshape(keep.shape[: log_det.ndim] + (-1,)).all(-1)
        log_det = jnp.where(keep, log_det, 0.0)
    return value, log_det


def data_template(arrays: dict[str, Any]) -> dict[str, jax.Array]:
    """The first unit of one silo's own ``arrays`` (leading axis of length 1).

    The server term runs the model on it only for the shapes that size the global
    sites: the sites inside the silo plate are left out of the sum. Real values, not
    an all-zero stand-in, keep NumPyro's argument checks valid when data sit in a
    scale, rate or count parameter (eight schools' known standard errors).
    """
    return {name: jnp.asarray(value)[:1] for name, value in arrays.items()}
