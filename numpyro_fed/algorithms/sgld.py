# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""FSGLD and DSGLD as pure functions: :func:`fsgld` returns a
:class:`~numpyro_fed.FederatedAlgorithm` that any runtime drives and that the
:class:`~numpyro_fed.FSGLD` / :class:`~numpyro_fed.DSGLD` MCMC kernels wrap.

One chain travels between silos (El Mekkaoui et al., Algorithm 1). Every ``tau`` steps
the server draws the next silo :math:`c_r \\sim \\mathrm{Cat}(f)`; the silo holding
the chain takes Langevin steps with the estimator (Eqs. 4, 5 and 7)

.. math::

    \\psi_s(\\theta) = \\nabla \\log p(\\theta)
    + \\frac{N_s}{f_s m} \\nabla \\log p(x_s^{(m)} \\mid \\theta)
    + \\alpha \\Big(\\nabla \\log q(\\theta) - \\frac{1}{f_s} \\nabla \\log q_s(\\theta)\\Big),

    \\theta_{t+1} = \\theta_t + \\frac{h_t}{2} \\psi_{s_t}(\\theta_t) + \\eta_t,
    \\qquad \\eta_t \\sim \\mathcal N(0, h_t I),

and hands back its trajectory. DSGLD is :math:`\\alpha = 0`. As in BlackJAX, the
first two terms are a plain ``(position, minibatch) -> gradient`` estimator
(:func:`grad_estimator`) and the conducive gradient wraps it as a control variate
(:func:`with_conducive_gradient`). Local latent sites of a silo (beyond the paper)
move only while the chain visits that silo, with their exact gradient
:math:`\\nabla_{z_{L_s}} \\log p(x_s, z_{L_s} \\mid z_G)` over the whole silo; the
average dynamics is Langevin preconditioned by the visit frequencies, whose
stationary law is the posterior as :math:`h \\to 0` when silos alternate often
(small ``tau``).

On the contract: ``select`` names the chain's silo :math:`c_r`; the server sends the
chain (global position and step counter) and each silo its own index; the silo takes
``steps_per_contact`` steps on its own data and local sites; the server moves the chain
to the end of the trajectory and draws the next silo (from its own chain key) when the
counter reaches a multiple of ``tau``. Step :math:`t` of a silo draws its minibatch and
Langevin noise from ``fold_in(key, t)`` of the silo's own ``key`` (the one the runtime
gives ``silo_step``), which the server never sees: knowing the noise, the server could
subtract it from the trajectory and read off the silo's minibatch gradient, and with
``batch_size=1`` invert it into the data row. ``reproducible=True`` is the old mode
kept for tests: the chain's key travels in the message and the silo draws from
``fold_in(chain_key, t)``, so every runtime gives the same chain whatever silo keys it
passes, and the server can replay every silo's noise and minibatch choice.

**References:**

1. *Federated Stochastic Gradient Langevin Dynamics*, K. El Mekkaoui, D. Mesquita,
   P. Blomstedt, S. Kaski (UAI 2021), Algorithm 1, Eqs. 3-7.
2. *Distributed Stochastic Gradient MCMC*, S. Ahn, B. Shahbaba, M. Welling (ICML 2014).
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from numpyro.infer.initialization import init_to_uniform

from numpyro_fed.algorithms.sgld_bounds import (
    ConduciveBound,
    bounded_position,
)
from numpyro_fed.expfam import GaussianNat, grad_log_density
from numpyro_fed.guard import guard_nonfinite
from numpyro_fed.potentials import FederatedPotential, batch_indices
from numpyro_fed.protocol import FederatedAlgorithm, Message, SiloData
from numpyro_fed.util import take, tree_where

__all__ = [
    "Estimator",
    "FSGLDInfo",
    "FSGLDServerMessage",
    "FSGLDServerState",
    "FSGLDSiloMessage",
    "FSGLDSiloState",
    "Minibatch",
    "SGLDConfig",
    "annealed_step_size",
    "choose_silo",
    "conducive_factors",
    "conducive_gradient",
    "dsgld",
    "fsgld",
    "grad_estimator",
    "init_chain",
    "silo_estimator",
    "with_conducive_gradient",
]


class SGLDConfig(NamedTuple):
    """Static settings of a chain (closed over by the algorithm's functions).

    - **step_size** - callable ``t -> h_t``.
    - **tau** - steps between silo draws.
    - **silo_probs** - :math:`f`, ``(J,)``.
    - **alpha** - weight of the conducive gradient (0: DSGLD).
    - **conducive** - the conducive gradients :math:`\\alpha g_s` as factors stacked
      by silo (:func:`conducive_factors`), or ``None`` (DSGLD: no surrogates).
    - **batch_size** - minibatch size ``m`` per silo, or ``None`` for the whole silo.
    - **replace** - minibatches drawn with replacement.
    - **local_steps** - ``K``: with ``K >= 1`` the silo first refreshes its local
      sites by ``K`` MALA moves at the fixed global position, and the global step
      averages its gradient over the ``K`` refreshed states; 0: the locals and
      globals take one Langevin step together.
    - **local_step_size** - callable ``t -> h^L_t`` of those moves, or ``None``:
      :math:`h_t / f_s` on silo :math:`s`.
    - **conducive_bound** - a
      :class:`~numpyro_fed.algorithms.sgld_bounds.ConduciveBound`, or ``None``.
    """

    step_size: Callable
    tau: int
    silo_probs: jax.Array
    alpha: float
    conducive: GaussianNat | None
    batch_size: int | None
    replace: bool
    local_steps: int = 0
    local_step_size: Callable | None = None
    conducive_bound: ConduciveBound | None = None


class FSGLDServerState(NamedTuple):
    """- **z_global** - unconstrained global sites (the chain's shared part).
    - **step** - global step counter :math:`t` (steps taken so far).
    - **silo** - :math:`c_r`, the silo holding the chain.
    - **rng_key** - the chain's key: the silo of a visit starting at step :math:`t`
      is drawn from ``fold_in(rng_key, t)`` (and, with ``reproducible=True``, so are
      the silos' minibatches and noise).
    """

    z_global: dict
    step: jax.Array
    silo: jax.Array
    rng_key: jax.Array


class FSGLDSiloState(NamedTuple):
    """- **z_local** - the silo's unconstrained local sites ``(P, ...)``; they never
    leave the silo."""

    z_local: dict


class FSGLDServerMessage(NamedTuple):
    """The broadcast part of the server's message: the chain handoff. (The routed
    part is each silo's own index, which picks its :math:`f_s` and conducive
    gradient.)

    - **z_global** - the chain's global position.
    - **step** - the global step counter.
    - **rng_key** - the chain's key with ``reproducible=True``; ``()`` (nothing is
      sent) in the default private mode, where the key stays with the server.
    """

    z_global: dict
    step: jax.Array
    rng_key: jax.Array | tuple


class FSGLDSiloMessage(NamedTuple):
    """Silo -> server: - **trajectory** - the global positions after each step of
    the contact, ``(steps_per_contact, ...)`` per site."""

    trajectory: dict


class FSGLDInfo(NamedTuple):
    """- **loss** - zero (a sampler has no objective).
    - **rejected** - ``(J,)`` booleans: the chain's silo replied with a non-finite
      trajectory, which was dropped (the chain stays where it was and its counter
      moves on, so the next draws differ).
    - **trajectory** - the chain's global positions after each step of the contact
      (the unchanged position, repeated, when the reply was dropped or did not
      arrive).
    """

    loss: jax.Array
    rejected: jax.Array
    trajectory: dict


class Minibatch(NamedTuple):
    """What a silo's gradient estimator reads.

    - **arrays** - the silo's padded arrays (units along axis 0).
    - **mask** - ``(P,)`` booleans, True for real units.
    - **idx** - ``(m,)`` slots of the minibatch (see
      :func:`~numpyro_fed.potentials.batch_indices`), or ``None``: the whole silo.
    - **nested** - plate name -> the silo's real size of each ragged nested plate
      (:attr:`~numpyro_fed.protocol.SiloData.nested`; empty when none).
    """

    arrays: dict
    mask: jax.Array
    idx: jax.Array | None = None
    nested: dict = {}


# (position, minibatch) -> gradient, BlackJAX's shape; the position is the flat
# global vector and the silo's local sites, and so is the gradient.
Estimator = Callable[[tuple[jax.Array, dict], Minibatch], tuple[jax.Array, dict]]


def annealed_step_size(a: float, b: float = 1.0, gamma: float = 0.55) -> Callable:
    """
    The polynomial decay :math:`h_t = a (b + t)^{-\\gamma}` (Welling & Teh 2011),
    which meets :math:`\\sum_t h_t = \\infty`, :math:`\\sum_t h_t^2 < \\infty` for
    :math:`\\gamma \\in (0.5, 1]`.

    **Example:**

    .. doctest::

        >>> from numpyro_fed.algorithms.sgld import annealed_step_size
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
        >>> from numpyro_fed.algorithms.sgld import conducive_gradient
        >>> grads, f = jnp.array([[1.0], [3.0]]), jnp.array([0.25, 0.75])
        >>> [float(conducive_gradient(grads, s, f)[0]) for s in (0, 1)]
        [0.0, 0.0]
    """
    return jnp.sum(silo_grads, 0) - silo_grads[silo] / silo_probs[silo]


def conducive_factors(
    surrogates: GaussianNat, silo_probs: Any, alpha: float = 1.0
) -> GaussianNat:
    r"""
    The conducive gradient of each silo as one Gaussian factor,
    :math:`\alpha g_s(\theta) = b_s - A_s \theta` with
    :math:`A_s = \alpha(\Lambda - \Lambda_s / f_s)` and
    :math:`b_s = \alpha(h - h_s / f_s)`, where :math:`(h, \Lambda)` is the product
    :math:`q = \prod_k q_k`: one matrix-vector product per step, whatever ``J``
    (:math:`A_s` is indefinite: a factor, not a density; it is made exactly
    symmetric).

    :param GaussianNat surrogates: the :math:`q_s`, stacked by silo.
    :param silo_probs: :math:`f`.
    :param float alpha: :math:`\alpha`.
    :return: :math:`(b_s, A_s)` stacked by silo.
    :rtype: ~numpyro_fed.expfam.GaussianNat
    """
    s = jax.tree.map(jnp.asarray, surrogates)
    q = jax.tree.map(lambda x: jnp.sum(x, 0), s)
    f = jnp.asarray(silo_probs)
    f_prec = f.reshape((-1,) + (1,) * (s.prec.ndim - 1))
    prec = alpha * (q.prec - s.prec / f_prec)
    if prec.ndim == 3:
        # grad_log_density reads A_s by columns (A_s^T theta): make it exactly
        # symmetric (a no-op for symmetric surrogates, such as fit_surrogates')
        prec = 0.5 * (prec + jnp.swapaxes(prec, -1, -2))
    return GaussianNat(alpha * (q.h - s.h / f[:, None]), prec)


def _keys(key: jax.Array, t: jax.Array) -> jax.Array:
    # The (silo choice, minibatch, noise) keys of step t: the server takes the first
    # from the chain's key, a silo the other two from its own key (from the chain's
    # with reproducible=True).
    return jax.random.split(jax.random.fold_in(key, t), 3)


def choose_silo(cfg: SGLDConfig, chain_key: jax.Array, t: jax.Array) -> jax.Array:
    """The silo :math:`c_r \\sim \\mathrm{Cat}(f)` of a round starting at step ``t``
    (from the first of the step's keys)."""
    key = _keys(chain_key, t)[0]
    return jax.random.categorical(key, jnp.log(cfg.silo_probs)).astype(jnp.int32)


def init_chain(cfg: SGLDConfig, z_global: dict, rng_key: jax.Array) -> FSGLDServerState:
    """The server state of a chain at ``z_global`` and step 0, its first silo drawn."""
    z_global = jax.tree.map(jnp.asarray, z_global)
    zero = jnp.zeros((), jnp.int32)
    return FSGLDServerState(z_global, zero, choose_silo(cfg, rng_key, zero), rng_key)


def grad_estimator(pot: FederatedPotential, silo_prob: jax.Array) -> Estimator:
    r"""
    DSGLD's estimator on one silo (Eq. 4): :math:`\nabla \log p(\theta) +
    \frac{N_s}{f_s m} \nabla \log p(x_s^{(m)} \mid \theta)` on the flattened global
    position, and the exact gradient of the silo's local sites.

    :param FederatedPotential pot: the model's potentials.
    :param silo_prob: :math:`f_s`.
    :return: ``((theta, z_local), Minibatch) -> (psi, local_grads)``.
    """

    def estimate(position, batch):
        theta, z_local = position
        z_global = pot.unflatten(theta)
        if batch.idx is None:
            g_lik, g_local = jax.grad(pot.silo_log_likelihood, argnums=(0, 1))(
                z_global, z_local, batch.arrays, batch.mask, batch.nested
            )
        else:
            num_real = jnp.sum(batch.mask)
            g_lik = jax.grad(pot.minibatch_log_likelihood)(
                z_global, z_local, batch.arrays, batch.idx, num_real, batch.nested
            )
            g_local = {}
            if z_local:  # the locals' exact gradient needs the whole silo
                g_local = jax.grad(pot.silo_log_likelihood, argnums=1)(
                    z_global, z_local, batch.arrays, batch.mask, batch.nested
                )
        prior = pot.flatten(jax.grad(pot.log_prior)(z_global))
        return prior + pot.flatten(g_lik) / silo_prob, g_local

    return estimate


def with_conducive_gradient(
    estimator: Estimator, factor: GaussianNat, bound: ConduciveBound | None = None
) -> Estimator:
    r"""
    ``estimator`` plus the silo's conducive gradient :math:`\alpha g_s(\theta) = b_s
    - A_s \theta` (Eq. 7): a control variate with mean zero over the silo choice.

    :param estimator: a ``(position, minibatch) -> gradient`` estimator.
    :param GaussianNat factor: the silo's :math:`(b_s, A_s)`, a row of
        :func:`conducive_factors`.
    :param ConduciveBound bound: evaluate the term at
        :func:`~numpyro_fed.algorithms.sgld_bounds.bounded_position` (the same
        point for every silo, so the mean stays zero), or ``None``: at
        :math:`\theta`.
    """

    def estimate(position, batch):
        psi, g_local = estimator(position, batch)
        theta = position[0] if bound is None else bounded_position(bound, position[0])
        return psi + grad_log_density(factor, theta), g_local

    return estimate


def silo_estimator(pot: FederatedPotential, cfg: SGLDConfig, silo: Any) -> Estimator:
    """The estimator of silo ``silo``: :func:`grad_estimator`, wrapped by
    :func:`with_conducive_gradient` when ``cfg`` has surrogates."""
    estimator = grad_estimator(pot, cfg.silo_probs[silo])
    if cfg.conducive is not None:
        factor = take(cfg.conducive, silo)
        estimator = with_conducive_gradient(estimator, factor, cfg.conducive_bound)
    return estimator


def _langevin_move(z_local, grads, h, keys, real):
    """One Langevin move of each local site (sorted by name, one key each) by
    ``grads`` at step size ``h``."""
    new = {}
    for k, name in zip(keys, sorted(z_local), strict=False):
        v = z_local[name]
        noise = jax.random.normal(k, v.shape, v.dtype)
        move = 0.5 * h * grads[name] + jnp.sqrt(h) * noise
        # Padded units and padded nested entries carry no density: they stay put.
        new[name] = v + jnp.where(real[name], move, 0.0)
    return new


def _local_move(pot, theta, z_local, data, h_local, key):
    """One MALA move of a silo's local sites at the fixed global position
    ``theta``, on their conditional given the globals: the Metropolis step keeps
    that law whatever ``h_local``."""
    z_global = pot.unflatten(theta)

    def log_target(z):
        return pot.silo_log_likelihood(z_global, z, data.arrays, data.mask, data.nested)

    lp_old, g_old = jax.value_and_grad(log_target)(z_local)
    real = pot.real_local(z_local, data.mask, data.nested)
    keys = jax.random.split(key, len(z_local) + 1)
    new = _langevin_move(z_local, g_old, h_local, keys, real)
    lp_new, g_new = jax.value_and_grad(log_target)(new)

    def log_q(to, frm, g):  # the proposal's log density frm -> to, up to a constant
        sq = [
            jnp.sum(jnp.where(real[n], (to[n] - frm[n] - 0.5 * h_local * g[n]) ** 2, 0))
            for n in to
        ]
        return sum(sq) / (-2.0 * h_local)

    log_ratio = (
        lp_new - lp_old + log_q(z_local, new, g_new) - log_q(new, z_local, g_old)
    )
    accept = jnp.log(jax.random.uniform(keys[-1], (), lp_new.dtype)) < log_ratio
    # A non-finite target (e.g. NaN data) would reject every move and freeze the
    # locals at finite values: let its NaNs show, so the chain's guards see them.
    accept = accept | ~jnp.isfinite(lp_old)
    return tree_where(accept, new, z_local)


def _langevin_step(pot, cfg, estimator, position, data, t, key, silo):
    """One Langevin step on one silo's ``data``; the draws come from
    ``fold_in(key, t)``."""
    _, k_batch, k_noise = _keys(key, t)
    h = cfg.step_size(t)
    mask = data.mask
    idx = None
    if cfg.batch_size is not None:
        idx = batch_indices(
            k_batch, jnp.sum(mask), mask.shape[0], cfg.batch_size, cfg.replace
        )
    batch = Minibatch(data.arrays, mask, idx, data.nested)
    theta, z_local = position
    k_global, k_local = jax.random.split(k_noise)
    if cfg.local_steps and z_local:
        h_local = h / cfg.silo_probs[silo]
        if cfg.local_step_size is not None:
            h_local = cfg.local_step_size(t)

        def refresh(total, k):
            # Stale locals leave a term in the global gradient that surrogates
            # marginal in the globals cannot cancel; averaging refreshed ones
            # estimates the marginal's gradient (Fisher's identity).
            z = _local_move(
                pot, theta, total[1], data, h_local, jax.random.fold_in(k_local, k)
            )
            return (total[0] + estimator((theta, z), batch)[0], z), None

        start = (jnp.zeros_like(theta), z_local)
        (psi, z_local), _ = jax.lax.scan(refresh, start, jnp.arange(cfg.local_steps))
        psi = psi / cfg.local_steps
    else:
        psi, g_local = estimator(position, batch)
        real = pot.real_local(z_local, mask, data.nested)
        local_keys = jax.random.split(k_local, max(len(z_local), 1))
        z_local = _langevin_move(z_local, g_local, h, local_keys, real)
    noise = jax.random.normal(k_global, theta.shape, theta.dtype)
    theta = theta + 0.5 * h * psi + jnp.sqrt(h) * noise
    return theta, z_local


def fsgld(
    pot: FederatedPotential,
    cfg: SGLDConfig,
    init_strategy: Callable = init_to_uniform,
    *,
    steps_per_contact: int | None = None,
    reject_nonfinite: bool = True,
    reproducible: bool = False,
) -> FederatedAlgorithm:
    """
    FSGLD (DSGLD when ``cfg.conducive`` is ``None``) as a
    :class:`~numpyro_fed.FederatedAlgorithm`. One round is one contact: ``select``
    names the chain's silo, which takes ``steps_per_contact`` Langevin steps and
    returns its trajectory; the server moves the chain and draws the next silo when
    its counter reaches a multiple of ``tau``.

    :param FederatedPotential pot: the model's potentials.
    :param SGLDConfig cfg: the chain's settings.
    :param callable init_strategy: NumPyro init strategy of ``init_server`` and
        ``init_silo``.
    :param int steps_per_contact: Langevin steps per contact, a divisor of
        ``cfg.tau`` (default ``cfg.tau``: one contact per visit, Algorithm 1; the
        MCMC kernels take 1, one step per sample).
    :param bool reject_nonfinite: drop a non-finite trajectory (the contract's
        guard against a faulty silo); the MCMC kernels turn it off, so a diverging
        chain shows NaNs, as NumPyro's samplers do, and skips the check's cost.
    :param bool reproducible: send the chain's key to the silo, which draws step
        :math:`t` from ``fold_in(chain_key, t)``: every runtime then gives the same
        chain whatever silo keys it passes, but the server can replay a silo's
        noise and minibatch choice (and invert a one-row minibatch's gradient into
        the row). Default ``False``: the silo draws from its own ``key``.
    :rtype: FederatedAlgorithm
    """
    steps = cfg.tau if steps_per_contact is None else steps_per_contact
    if not isinstance(steps, int) or steps < 1 or cfg.tau % steps:
        raise ValueError(
            f"steps_per_contact must be a positive divisor of tau={cfg.tau}, got "
            f"{steps_per_contact!r}."
        )
    num_silos = cfg.silo_probs.shape[0]

    def init_server(key: jax.Array) -> FSGLDServerState:
        init_key, chain_key = jax.random.split(key)
        return init_chain(cfg, pot.init_global(init_key, init_strategy), chain_key)

    def init_silo(key: jax.Array, data: SiloData) -> FSGLDSiloState:
        return FSGLDSiloState(pot.init_local(key, data.arrays, init_strategy))

    def server_message(state: FSGLDServerState, key: jax.Array) -> Message:
        del key
        chain_key = state.rng_key if reproducible else ()
        chain = FSGLDServerMessage(state.z_global, state.step, chain_key)
        return Message(chain, jnp.arange(num_silos, dtype=jnp.int32))

    def silo_step(message: Message, state: FSGLDSiloState, data: SiloData, key):
        chain, silo = message.broadcast, message.routed
        draw_key = chain.rng_key if reproducible else key
        estimator = silo_estimator(pot, cfg, silo)

        def body(position, i):
            position = _langevin_step(
                pot,
                cfg,
                estimator,
                position,
                data,
                chain.step + i,
                draw_key,
                silo,
            )
            return position, pot.unflatten(position[0])

        start = (pot.flatten(chain.z_global), state.z_local)
        (_, z_local), trajectory = jax.lax.scan(
            body, start, jnp.arange(steps, dtype=jnp.int32), unroll=steps == 1
        )
        return FSGLDSiloMessage(trajectory), FSGLDSiloState(z_local)

    def select(state: FSGLDServerState, key: jax.Array, num: int) -> jax.Array:
        del key
        return jnp.arange(num) == state.silo

    def server_step(state: FSGLDServerState, replies, key, participating):
        del key
        silo = state.silo
        reply = take(replies, silo)
        arrived = participating[silo]
        here = jax.tree.map(
            lambda x: jnp.broadcast_to(x, (steps,) + jnp.shape(x)), state.z_global
        )
        trajectory = tree_where(arrived, reply.trajectory, here)
        step = jnp.where(arrived, state.step + steps, state.step)
        # The Cat(f) draw costs O(J) (a Gumbel per silo): a cond pays it once per
        # visit, not every step (under vmap with per-chain counters it is a select).
        silo = jax.lax.cond(
            arrived & (step % cfg.tau == 0),
            lambda: choose_silo(cfg, state.rng_key, step),
            lambda: silo,
        )
        new = FSGLDServerState(take(trajectory, -1), step, silo, state.rng_key)
        loss = jnp.zeros((), jnp.result_type(float))
        return new, FSGLDInfo(loss, jnp.zeros_like(participating), trajectory)

    algorithm = FederatedAlgorithm(
        init_server, init_silo, server_message, silo_step, server_step, select
    )
    # The MCMC kernel keeps a diverging chain's NaNs in its samples, as NumPyro's
    # kernels do; every other runtime rejects a non-finite trajectory.
    return guard_nonfinite(algorithm) if reject_nonfinite else algorithm


def dsgld(
    pot: FederatedPotential,
    cfg: SGLDConfig,
    init_strategy: Callable = init_to_uniform,
    *,
    steps_per_contact: int | None = None,
    reject_nonfinite: bool = True,
    reproducible: bool = False,
) -> FederatedAlgorithm:
    """DSGLD (Ahn et al. 2014): :func:`fsgld` without surrogates (``alpha = 0``);
    ``cfg``'s surrogates, if any, are ignored."""
    cfg = cfg._replace(alpha=0.0, conducive=None)
    return fsgld(
        pot,
        cfg,
        init_strategy,
        steps_per_contact=steps_per_contact,
        reject_nonfinite=reject_nonfinite,
        reproducible=reproducible,
    )
