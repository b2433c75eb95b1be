# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""PVI's states and messages (:func:`~numpyro_fed.algorithms.pvi.pvi`), and the
:class:`Cavity`: what the server sends and how a silo divides it by its own factor,
which Fed-GVI (:mod:`~numpyro_fed.algorithms.fedgvi`) replaces."""

from typing import Any, Callable, NamedTuple

import jax

from numpyro_fed.expfam import GaussianNat, kl

__all__ = [
    "Cavity",
    "PVIInfo",
    "PVIServerMessage",
    "PVIServerState",
    "PVISiloMessage",
    "PVISiloState",
    "kl_cavity",
]


class PVISiloState(NamedTuple):
    """Everything a silo keeps (none of it leaves the silo).

    - **factor** - its approximate likelihood factor :math:`t_m` (natural parameters),
      as committed.
    - **pending** - the update :math:`\\Delta\\eta_m` it last sent, committed (times
      the server's acknowledgement) at its next step; zero when there is none.
    - **eta_local** - unconstrained parameters of its local guide (units first).
    - **optim_state** - its optimizer's state over (global q, local guide).
    - **rng_key** - its own key chain for Monte Carlo noise, across rounds.
    """

    factor: GaussianNat
    pending: GaussianNat
    eta_local: dict
    optim_state: Any
    rng_key: jax.Array


class PVIServerState(NamedTuple):
    """- **q** - the authoritative posterior :math:`\\eta_q` over the global vector.
    - **prior** - :math:`\\eta_0`: the exact Gaussian prior, or the refined factor
      :math:`t_0` standing for a non-Gaussian one.
    - **theta** - unconstrained model parameters (``numpyro.param`` sites).
    - **optim_state** - the server optimizer's state over ``theta``.
    - **ack** - ``(J,)``: the fraction of each silo's last update that the server
      applied (0 if it was dropped), sent back in the next routed message.
    - **prior_optim**, **prior_key** - the :math:`t_0` refinement's optimizer state
      and key chain (kept, unused, with an exact prior: the structure is fixed).
    """

    q: GaussianNat
    prior: GaussianNat
    theta: dict
    optim_state: Any
    ack: jax.Array
    prior_optim: Any
    prior_key: jax.Array


class PVIServerMessage(NamedTuple):
    """Server -> silos, the broadcast part (the routed part is each silo's ``ack``).

    - **q** - :math:`\\eta_q`.
    - **theta** - unconstrained model parameters.
    """

    q: GaussianNat
    theta: dict


class PVISiloMessage(NamedTuple):
    """Silo -> server.

    - **delta** - :math:`\\Delta\\eta_m`, the damped change of the silo's factor.
    - **grad_theta** - gradient of the silo's expected log-likelihood w.r.t. the
      unconstrained model parameters at the received :math:`q` (Bui et al., eq. 5).
    - **elbo** - the silo's term :math:`E_q[\\log p(y_m, z_m \\mid u) - \\log q(z_m)]`
      at the received :math:`q`, for the global free energy.
    - **valid_cavity** - whether the silo's cavity was a valid Gaussian; if not, the
      silo did not update and ``delta`` is zero.
    """

    delta: GaussianNat
    grad_theta: dict
    elbo: jax.Array
    valid_cavity: jax.Array


class PVIInfo(NamedTuple):
    """- **loss** - minus the global free energy estimate: the contributing silos'
      terms (each at the :math:`q` it received, scaled by :math:`J` over their count)
      plus the server's :math:`-D(q \\| p)` at the step's start.
    - **rejected** - ``(J,)``: replies that arrived and were dropped (not finite, or
      from an invalid cavity).
    - **scale** - the fraction of the summed update the server applied (< 1 when it
      had to shrink the step to keep :math:`q` valid).
    - **invalid_cavity** - index of a silo whose cavity was not a valid Gaussian, or -1.
    """

    loss: jax.Array
    rejected: jax.Array
    scale: jax.Array
    invalid_cavity: jax.Array


class Cavity(NamedTuple):
    """What the server sends and how a silo divides it by its own factor.

    - **message** - ``(q, prior, theta) -> broadcast``: the broadcast part of the
      server's message when its authoritative natural parameters are ``q``; it has
      at least the fields ``q`` (the silos' starting point) and ``theta``.
    - **of** - ``(broadcast, factor) -> GaussianNat``: a silo's cavity.
    - **divergence** - ``(q, prior) -> D(q || prior)``, the server's (exact prior) term.
    """

    message: Callable
    of: Callable
    divergence: Callable


def kl_cavity() -> Cavity:
    """PVI's cavity :math:`q / t_m`, with :math:`q` sent as it is and the KL
    divergence to the prior."""
    return Cavity(
        message=lambda q, prior, theta: PVIServerMessage(q, theta),
        of=lambda message, factor: message.q.minus(factor),
        divergence=kl,
    )
