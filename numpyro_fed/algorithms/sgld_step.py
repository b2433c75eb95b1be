# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""FSGLD and DSGLD: the chain state and its pure step functions.

One chain travels between silos (El Mekkaoui et al., Algorithm 1). Every ``tau`` steps
the server draws the next silo :math:`c_r \\sim \\mathrm{Cat}(f)`; the silo holding
the chain takes ``tau`` Langevin steps with the estimator (Eqs. 4, 5 and 7)

.. math::

    \\psi_s(\\theta) = \\nabla \\log p(\\theta)
    + \\frac{N_s}{f_s m} \\nabla \\log p(x_s^{(m)} \\mid \\theta)
    + \\alpha \\Big(\\nabla \\log q(\\theta) - \\frac{1}{f_s} \\nabla \\log q_s(\\theta)\\Big),

    \\theta_{t+1} = \\theta_t + \\frac{h_t}{2} \\psi_{s_t}(\\theta_t) + \\eta_t,
    \\qquad \\eta_t \\sim \\mathcal N(0, h_t I),

and hands back its trajectory. DSGLD is :math:`\\alpha = 0`. Local latent sites of a
silo (beyond the paper) move only while the chain visits that silo, with their exact
gradient :math:`\\nabla_{z_{L_s}} \\log p(x_s, z_{L_s} \\mid z_G)` over the whole silo;
the average dynamics is Langevin preconditioned by the visit frequencies, whose
stationary law is the posterior as :math:`h \\to 0` when silos alternate often (small
``tau``).

The draws of step :math:`t` come from ``fold_in(rng_key, t)`` of the chain's key, so
the MCMC kernel (:mod:`numpyro_fed.algorithms.sgld`, all steps in one jitted loop) and
the message protocol (:mod:`numpyro_fed.algorithms.sgld_protocol`) give the same
chain draw for draw.

**References:**

1. *Federated Stochastic Gradient Langevin Dynamics*, K. El Mekkaoui, D. Mesquita,
   P. Blomstedt, S. Kaski (UAI 2021), Algorithm 1, Eqs. 3-7.
2. *Distributed Stochastic Gradient MCMC*, S. Ahn, B. Shahbaba, M. Welling (ICML 2014).
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from numpyro_fed.potentials import FederatedPotential, batch_indices
from numpyro_fed.protocol import SiloData
from numpyro_fed.surrogates import (
    GaussianSurrogates,
    surrogate_grad,
    surrogate_product,
)

__all__ = [
    "ChainSurrogates",
    "SGLDConfig",
    "SGLDState",
    "annealed_step_size",
    "choose_silo",
    "conducive_gradient",
    "estimator",
    "init",
    "local_step",
    "step",
]


class SGLDState(NamedTuple):
    """State of a DSGLD/FSGLD chain.

    - **z** - unconstrained position: global sites, and local sites stacked
      ``(J, P, ...)`` by silo and padded unit.
    - **step** - the global step counter :math:`t` (steps taken so far); it drives
      the annealed step size and the silo schedule.
    - **silo** - the silo :math:`c_r` holding the chain in the current round.
    - **rng_key** - the chain's key; step :math:`t` draws from ``fold_in(rng_key, t)``.
    """

    z: dict
    step: jax.Array
    silo: jax.Array
    rng_key: jax.Array


class SGLDConfig(NamedTuple):
    """Static settings of a chain (closed over by the step functions).

    - **step_size** - callable ``t -> h_t``.
    - **tau** - local steps per visit.
    - **silo_probs** - :math:`f`, ``(J,)``.
    - **alpha** - weight of the conducive gradient (0: DSGLD).
    - **surrogates** - :class:`ChainSurrogates` (per-silo natural parameters and
      their product), or ``None`` (DSGLD).
    - **batch_size** - minibatch size ``m`` per silo, or ``None`` for the whole silo.
    - **replace** - minibatches drawn with replacement.
    """

    step_size: Callable
    tau: int
    silo_probs: jax.Array
    alpha: float
    surrogates: "ChainSurrogates | None"
    batch_size: int | None
    replace: bool


class ChainSurrogates(NamedTuple):
    r"""The conducive gradient of each silo as one affine map,
    :math:`\alpha g_s(\theta) = b_s - A_s \theta` with
    :math:`A_s = \alpha(\Lambda - \Lambda_s / f_s)` and
    :math:`b_s = \alpha(h - h_s / f_s)`, where :math:`(\Lambda, h)` is the product
    :math:`q = \prod_k q_k`: one matrix-vector product per step, whatever ``J``.

    - **precision** - :math:`A_s`, ``(J, D, D)`` or ``(J, D)`` (diagonal surrogates).
    - **shift** - :math:`b_s`, ``(J, D)``.
    """

    precision: jax.Array
    shift: jax.Array

    @classmethod
    def of(
        cls, s: GaussianSurrogates, silo_probs: Any, alpha: float = 1.0
    ) -> "ChainSurrogates":
        """From per-silo :class:`~numpyro_fed.GaussianSurrogates`, :math:`f` and
        :math:`\alpha`."""
        s = GaussianSurrogates(jnp.asarray(s.precision), jnp.asarray(s.shift))
        q = surrogate_product(s)
        f = jnp.asarray(silo_probs)
        f_prec = f.reshape((-1,) + (1,) * (s.precision.ndim - 1))
        return cls(
            alpha * (q.precision - s.precision / f_prec),
            alpha * (q.shift - s.shift / f[:, None]),
        )


def annealed_step_size(a: float, b: float = 1.0, gamma: float = 0.55) -> Callable:
    """
    The polynomial decay :math:`h_t = a (b + t)^{-\\gamma}` (Welling & Teh 2011),
    which meets :math:`\\sum_t h_t = \\infty`, :math:`\\sum_t h_t^2 < \\infty` for
    :math:`\\gamma \\in (0.5, 1]`.

    **Example:**

    .. doctest::

        >>> from numpyro_fed.algorithms.sgld_step import annealed_step_size
        >>> h = annealed_step_size(1e-2, b=1.0, gamma=1.0)
        >>> float(h(0)), float(h(9))
        (0.01, 0.001)
    """
    if not (a > 0 and b > 0 and gamma > 0):
        raise ValueError(
            f"annealed_step_size needs a, b, gamma > 0; got {a}, {b}, {gamma}."
        )
    return lambda t: a * (b + t) ** (-gamma)


def conducive_gradient(
    silo_grads: jax.Array, silo: jax.Array, silo_probs: jax.Array
) -> jax.Array:
    """
    :math:`g_s = \\sum_k \\nabla \\log q_k - f_s^{-1} \\nabla \\log q_s` (Eq. 6) from
    the per-silo surrogate gradients ``(J, D)``; :math:`\\sum_s f_s g_s = 0`.

    **Example:**

    .. doctest::

        >>> import jax.numpy as jnp
        >>> from numpyro_fed.algorithms.sgld_step import conducive_gradient
        >>> grads, f = jnp.array([[1.0], [3.0]]), jnp.array([0.25, 0.75])
        >>> [float(conducive_gradient(grads, s, f)[0]) for s in (0, 1)]
        [0.0, 0.0]
    """
    return jnp.sum(silo_grads, 0) - silo_grads[silo] / silo_probs[silo]


def _keys(chain_key: jax.Array, t: jax.Array) -> jax.Array:
    return jax.random.split(jax.random.fold_in(chain_key, t), 3)


def choose_silo(cfg: SGLDConfig, chain_key: jax.Array, t: jax.Array) -> jax.Array:
    """The silo :math:`c_r \\sim \\mathrm{Cat}(f)` of a round starting at step ``t``
    (from the first of the step's keys, so the kernel and the protocol agree)."""
    key = _keys(chain_key, t)[0]
    return jax.random.categorical(key, jnp.log(cfg.silo_probs)).astype(jnp.int32)


def estimator(
    pot: FederatedPotential,
    cfg: SGLDConfig,
    z_global: dict,
    z_local: dict,
    silo: jax.Array,
    arrays: dict,
    mask: jax.Array,
    idx: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    r"""
    The drift of a step on silo ``silo``: :math:`\psi_s` of Eq. 7 (prior included) on
    the flattened global position, and the exact gradient of the silo's local sites.

    :param jax.Array idx: minibatch slots (see
        :func:`~numpyro_fed.potentials.batch_indices`), or ``None`` for the whole silo.
    :return: ``(psi, local_grads)``.
    """
    f_s = cfg.silo_probs[silo]
    if idx is None:
        g_lik, g_local = jax.grad(pot.silo_log_likelihood, argnums=(0, 1))(
            z_global, z_local, arrays, mask
        )
    else:
        g_lik = jax.grad(pot.minibatch_log_likelihood)(
            z_global, z_local, arrays, idx, jnp.sum(mask)
        )
        g_local = {}
        if z_local:  # the locals' exact gradient needs the whole silo
            g_local = jax.grad(pot.silo_log_likelihood, argnums=1)(
                z_global, z_local, arrays, mask
            )
    theta = pot.flatten(z_global)
    psi = pot.flatten(jax.grad(pot.log_prior)(z_global)) + pot.flatten(g_lik) / f_s
    if cfg.surrogates is not None:
        own = GaussianSurrogates(
            cfg.surrogates.precision[silo], cfg.surrogates.shift[silo]
        )
        psi = psi + surrogate_grad(own, theta)  # alpha g_s = b_s - A_s theta
    return psi, g_local


def local_step(
    pot: FederatedPotential,
    cfg: SGLDConfig,
    z_global: dict,
    z_local: dict,
    silo: jax.Array,
    arrays: dict,
    mask: jax.Array,
    t: jax.Array,
    chain_key: jax.Array,
) -> tuple[dict, dict]:
    """One Langevin step on silo ``silo``, using only that silo's data and locals;
    the draws come from ``fold_in(chain_key, t)``.

    :return: the new ``(z_global, z_local)``; ``z_local`` is the silo's ``(P, ...)``.
    """
    _, k_batch, k_noise = _keys(chain_key, t)
    h = cfg.step_size(t)
    idx = None
    if cfg.batch_size is not None:
        idx = batch_indices(
            k_batch, jnp.sum(mask), mask.shape[0], cfg.batch_size, cfg.replace
        )
    psi, g_local = estimator(pot, cfg, z_global, z_local, silo, arrays, mask, idx)
    theta = pot.flatten(z_global)
    k_global, k_local = jax.random.split(k_noise)
    noise = jax.random.normal(k_global, theta.shape, theta.dtype)
    theta = theta + 0.5 * h * psi + jnp.sqrt(h) * noise
    new_local = {}
    local_keys = jax.random.split(k_local, max(len(z_local), 1))
    for k, name in zip(local_keys, sorted(z_local), strict=False):
        v = z_local[name]
        real = mask.reshape(mask.shape + (1,) * (v.ndim - 1))
        noise = jax.random.normal(k, v.shape, v.dtype)
        move = 0.5 * h * g_local[name] + jnp.sqrt(h) * noise
        new_local[name] = v + jnp.where(real, move, 0.0)  # padded units stay put
    return pot.unflatten(theta), new_local


def init(pot: FederatedPotential, z: dict, rng_key: jax.Array) -> SGLDState:
    """The initial chain state at position ``z`` (step 0; the silo is drawn then)."""
    z = jax.tree.map(jnp.asarray, z)
    return SGLDState(z, jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), rng_key)


def step(
    pot: FederatedPotential, cfg: SGLDConfig, state: SGLDState, data: SiloData
) -> SGLDState:
    """
    One step of the chain: at the start of a round (``step % tau == 0``) draw the
    silo :math:`c_r \\sim \\mathrm{Cat}(f)`, then take a :func:`local_step` there.

    :param SiloData data: all silos' data, stacked (the step reads only one silo's).
    """
    t = state.step
    # The Cat(f) draw costs O(J) (a Gumbel per silo): a cond pays it once per round,
    # not every step (under vmap with per-chain counters it becomes a select).
    silo = jax.lax.cond(
        t % cfg.tau == 0,
        lambda: choose_silo(cfg, state.rng_key, t),
        lambda: state.silo.astype(jnp.int32),
    )
    z_global, z_local = pot.split(state.z)
    own = {k: v[silo] for k, v in z_local.items()}
    arrays = {k: v[silo] for k, v in data.arrays.items()}
    z_global, own = local_step(
        pot, cfg, z_global, own, silo, arrays, data.mask[silo], t, state.rng_key
    )
    z_local = {k: v.at[silo].set(own[k]) for k, v in z_local.items()}
    return SGLDState({**z_global, **z_local}, t + 1, silo, state.rng_key)
