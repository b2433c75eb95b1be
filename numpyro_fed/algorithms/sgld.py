# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""FSGLD and DSGLD: federated Langevin samplers as NumPyro MCMC kernels.

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
the MCMC kernel (all steps in one jitted loop) and the message protocol (server and
silos under a runtime) give the same chain draw for draw.

**References:**

1. *Federated Stochastic Gradient Langevin Dynamics*, K. El Mekkaoui, D. Mesquita,
   P. Blomstedt, S. Kaski (UAI 2021), Algorithm 1, Eqs. 3-7.
2. *Distributed Stochastic Gradient MCMC*, S. Ahn, B. Shahbaba, M. Welling (ICML 2014).
"""

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer.initialization import init_to_uniform
from numpyro.infer.mcmc import MCMCKernel
from numpyro.util import identity, is_prng_key

from numpyro_fed.data import FederatedData
from numpyro_fed.potentials import (
    FederatedPotential,
    batch_indices,
    federated_potential,
)
from numpyro_fed.protocol import FederatedAlgorithm, SiloData, silo_data_of
from numpyro_fed.surrogates import (
    GaussianSurrogates,
    check_surrogates,
    surrogate_grad,
    surrogate_product,
)

__all__ = [
    "DSGLD",
    "FSGLD",
    "ChainSurrogates",
    "CommStats",
    "FSGLDServerMessage",
    "FSGLDServerState",
    "FSGLDSiloMessage",
    "FSGLDSiloState",
    "ProtocolResult",
    "SGLDConfig",
    "SGLDState",
    "annealed_step_size",
    "conducive_gradient",
    "estimator",
    "local_step",
    "fsgld",
    "init",
    "step",
]


# ------------------------------------------------------------------ states
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


def _keys(chain_key: jax.Array, t: jax.Array) -> jax.Array:
    return jax.random.split(jax.random.fold_in(chain_key, t), 3)


def _choose_silo(cfg: SGLDConfig, chain_key: jax.Array, t: jax.Array) -> jax.Array:
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
    silo = jnp.where(
        t % cfg.tau == 0, _choose_silo(cfg, state.rng_key, t), state.silo
    ).astype(jnp.int32)
    z_global, z_local = pot.split(state.z)
    own = {k: v[silo] for k, v in z_local.items()}
    arrays = {k: v[silo] for k, v in data.arrays.items()}
    z_global, own = local_step(
        pot, cfg, z_global, own, silo, arrays, data.mask[silo], t, state.rng_key
    )
    z_local = {k: v.at[silo].set(own[k]) for k, v in z_local.items()}
    return SGLDState({**z_global, **z_local}, t + 1, silo, state.rng_key)


# ------------------------------------------------------------------ protocol
class FSGLDServerState(NamedTuple):
    """- **z_global** - unconstrained global sites (the chain's shared part).
    - **step** - global step counter.
    - **silo** - the silo to visit next.
    - **rng_key** - the chain's key.
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
    """Server -> the chosen silo: the chain handoff.

    - **z_global** - the chain's global position.
    - **step** - the global step counter.
    - **silo** - the addressee's index (routing header; selects :math:`f_s, q_s`).
    - **rng_key** - the chain's key (the draws of step ``t`` are ``fold_in(key, t)``).
    """

    z_global: dict
    step: jax.Array
    silo: jax.Array
    rng_key: jax.Array


class FSGLDSiloMessage(NamedTuple):
    """Silo -> server: the local trajectory.

    - **trajectory** - the ``tau`` global positions after each local step.
    - **step** - the step counter after the visit.
    """

    trajectory: dict
    step: jax.Array


def fsgld(pot: FederatedPotential, cfg: SGLDConfig, init_strategy=init_to_uniform):
    """
    The chain handoff as a :class:`~numpyro_fed.FederatedAlgorithm`. One round is one
    visit: the server sends the chain to silo :math:`c_r` (the runtime contacts only
    that silo: ``participating`` is its one-hot), the silo takes ``tau`` steps and
    returns its trajectory, and the server draws the next silo.

    :param FederatedPotential pot: the model's potentials.
    :param SGLDConfig cfg: the chain's settings.
    :rtype: FederatedAlgorithm
    """

    def init_server(key: jax.Array) -> FSGLDServerState:
        init_key, chain_key = jax.random.split(key)
        z_global = pot.init_global(init_key, init_strategy)
        zero = jnp.zeros((), jnp.int32)
        return FSGLDServerState(
            z_global, zero, _choose_silo(cfg, chain_key, zero), chain_key
        )

    def init_silo(key: jax.Array, data: SiloData) -> FSGLDSiloState:
        return FSGLDSiloState(pot.init_local(key, data.arrays, init_strategy))

    def server_message(state: FSGLDServerState, key: jax.Array) -> FSGLDServerMessage:
        del key
        return FSGLDServerMessage(state.z_global, state.step, state.silo, state.rng_key)

    def silo_step(message, state: FSGLDSiloState, data: SiloData, key: jax.Array):
        del key  # the chain's key travels with it

        def body(carry, i):
            z_global, z_local = carry
            z_global, z_local = local_step(
                pot,
                cfg,
                z_global,
                z_local,
                message.silo,
                data.arrays,
                data.mask,
                message.step + i,
                message.rng_key,
            )
            return (z_global, z_local), z_global

        steps = jnp.arange(cfg.tau, dtype=jnp.int32)
        (_, z_local), trajectory = jax.lax.scan(
            body, (message.z_global, state.z_local), steps
        )
        reply = FSGLDSiloMessage(trajectory, message.step + cfg.tau)
        return reply, FSGLDSiloState(z_local)

    def server_step(state: FSGLDServerState, replies, key, participating=None):
        del key
        if participating is None:
            raise ValueError(
                "FSGLD visits one silo per round: pass participating=one_hot(silo)."
            )
        chosen = jnp.argmax(participating)
        reply = jax.tree.map(lambda x: x[chosen], replies)
        z_global = jax.tree.map(lambda x: x[-1], reply.trajectory)
        silo = _choose_silo(cfg, state.rng_key, reply.step)
        new = FSGLDServerState(z_global, reply.step, silo, state.rng_key)
        return new, reply.trajectory

    return FederatedAlgorithm(
        init_server, init_silo, server_message, silo_step, server_step
    )


class CommStats(NamedTuple):
    """Communication of a protocol run.

    - **rounds** - chain handoffs (= steps / tau).
    - **steps** - Langevin steps taken.
    - **surrogate_messages** - silo -> server surrogate uploads (once per silo).
    - **surrogate_bytes** - their bytes, plus the product broadcast to each silo.
    - **server_to_silo_messages** / **server_to_silo_bytes** - chain handoffs sent.
    - **silo_to_server_messages** / **silo_to_server_bytes** - trajectories returned.
    """

    rounds: int
    steps: int
    surrogate_messages: int
    surrogate_bytes: int
    server_to_silo_messages: int
    server_to_silo_bytes: int
    silo_to_server_messages: int
    silo_to_server_bytes: int


class ProtocolResult(NamedTuple):
    """- **samples** - constrained global sites, ``(rounds * tau, ...)`` per site.
    - **server_state** - the final :class:`FSGLDServerState`.
    - **silo_states** - the final :class:`FSGLDSiloState`, stacked by silo.
    - **stats** - :class:`CommStats`.
    """

    samples: dict
    server_state: FSGLDServerState
    silo_states: FSGLDSiloState
    stats: CommStats


def _nbytes(tree: Any) -> int:
    total = 0
    for leaf in jax.tree.leaves(tree):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
            leaf = jax.random.key_data(leaf)
        total += int(np.prod(leaf.shape)) * leaf.dtype.itemsize
    return total


# ------------------------------------------------------------------ kernels
def _check_step_size(step_size: Any) -> Callable:
    if callable(step_size):
        h0 = float(step_size(jnp.zeros((), jnp.int32)))
        if not h0 > 0:
            raise ValueError(f"step_size(0) must be positive, got {h0}.")
        return step_size
    if isinstance(step_size, bool) or not np.isscalar(step_size) or not step_size > 0:
        raise ValueError(
            f"step_size must be a positive number or a callable t -> h_t, got {step_size!r}."
        )
    h = float(step_size)
    return lambda t: jnp.asarray(h)


def _check_probs(silo_probs: Any, num_silos: int | None = None) -> np.ndarray | None:
    if silo_probs is None:
        return None
    f = np.asarray(silo_probs, dtype=float)
    if f.ndim != 1 or not np.all(f > 0) or not abs(f.sum() - 1) < 1e-6:
        raise ValueError(
            "silo_probs must be positive probabilities, one per silo, summing to 1; "
            f"got {f.tolist()} (sum {f.sum():.6g})."
        )
    if num_silos is not None and len(f) != num_silos:
        raise ValueError(
            f"silo_probs has {len(f)} entries but the data hold {num_silos} silos."
        )
    return f


def pooled_model(model: Callable) -> Callable:
    """``model`` called on ``FederatedData.pooled()``: what ArviZ and ``Predictive``
    run with the kernel's ``(data,)`` arguments."""

    def pooled(data: Any, *args: Any, **kwargs: Any) -> Any:
        return model(*args, **kwargs, **data.pooled())

    return pooled


class FSGLD(MCMCKernel):
    """
    Federated SGLD with conducive gradients (El Mekkaoui et al., Algorithm 1) as a
    NumPyro :class:`~numpyro.infer.mcmc.MCMCKernel`. One MCMC sample is one Langevin
    step; run it with ``MCMC(...).run(rng_key, data)`` on a
    :class:`~numpyro_fed.FederatedData`, then use ``get_samples``, ``print_summary``
    and ``arviz.from_numpyro`` as with NUTS (local sites come back in pooled order).

    :param callable model: a federated model (:func:`~numpyro_fed.federate` or
        :class:`~numpyro_fed.silo_plate`) called with the silo arrays only.
    :param step_size: :math:`h`, a positive float, or a callable ``t -> h_t`` of the
        global step counter (e.g. :func:`annealed_step_size`).
    :param GaussianSurrogates surrogates: one :math:`q_s` per silo, from
        :func:`~numpyro_fed.fit_surrogates`.
    :param int tau: local steps per visit (Algorithm 1's :math:`T`).
    :param silo_probs: :math:`f`, visit probabilities (default uniform).
    :param float alpha: weight of the conducive gradient (Eq. 7).
    :param int batch_size: minibatch size ``m`` per silo (default: the whole silo).
    :param bool replace: draw minibatches with replacement (the authors' code).
    :param callable init_strategy: NumPyro init strategy for the initial position.

    **Example:**

    .. doctest::

        >>> import jax, jax.numpy as jnp
        >>> import numpyro, numpyro.distributions as dist
        >>> from numpyro.infer import MCMC
        >>> import numpyro_fed as nf
        >>> def model(y):
        ...     mu = numpyro.sample("mu", dist.Normal(0, 10))
        ...     with nf.silo_plate("data", y.shape[0]):
        ...         numpyro.sample("y", dist.Normal(mu, 1), obs=y)
        >>> y = jnp.arange(40.0) / 10
        >>> data = nf.FederatedData.from_groups(jnp.arange(40) // 10, y=y)
        >>> q = nf.fit_surrogates(model, data)
        >>> kernel = nf.FSGLD(model, 5e-3, q, tau=10)
        >>> mcmc = MCMC(kernel, num_warmup=200, num_samples=2000, progress_bar=False)
        >>> mcmc.run(jax.random.key(0), data)
        >>> mean = float(mcmc.get_samples()["mu"].mean())  # posterior: 1.95 +- 0.16
        >>> abs(mean - 1.95) < 0.08
        True
    """

    sample_field = "z"

    def __init__(
        self,
        model: Callable,
        step_size: Any,
        surrogates: GaussianSurrogates | None,
        tau: int = 1,
        silo_probs: Any = None,
        alpha: float = 1.0,
        batch_size: int | None = None,
        *,
        replace: bool = True,
        init_strategy: Callable = init_to_uniform,
    ) -> None:
        self._model = model
        self._step_size = _check_step_size(step_size)
        if isinstance(tau, bool) or not isinstance(tau, (int, np.integer)) or tau < 1:
            raise ValueError(
                f"tau (local steps per visit) must be an int >= 1, got {tau!r}."
            )
        if batch_size is not None and (
            not isinstance(batch_size, (int, np.integer)) or batch_size < 1
        ):
            raise ValueError(
                f"batch_size must be None or an int >= 1, got {batch_size!r}."
            )
        if not np.isfinite(alpha):
            raise ValueError(f"alpha must be finite, got {alpha!r}.")
        if surrogates is not None:
            check_surrogates(surrogates)
        self._surrogates = surrogates
        self._tau = int(tau)
        self._silo_probs = _check_probs(silo_probs)
        self._alpha = float(alpha)
        self._batch_size = batch_size
        self._replace = bool(replace)
        self._init_strategy = init_strategy
        self._built: dict = {}
        self._sample_fn = None

    # ------------------------------------------------------------ construction
    @staticmethod
    def _data(model_args: tuple, model_kwargs: dict | None) -> Any:
        if (
            model_kwargs
            or len(model_args) != 1
            or not isinstance(model_args[0], FederatedData)
        ):
            raise TypeError(
                "Run the kernel as MCMC(kernel, ...).run(rng_key, data) with one "
                "FederatedData; bind other model arguments with functools.partial."
            )
        return model_args[0]

    def _setup(self, data: Any) -> tuple[FederatedPotential, SGLDConfig]:
        layout = (data.sizes, data.padded_size) + tuple(
            (k, v.shape, str(v.dtype)) for k, v in sorted(data.arrays.items())
        )
        if layout not in self._built:
            pot = federated_potential(self._model, data)
            f = _check_probs(self._silo_probs, data.num_silos)
            if f is None:
                f = np.full(data.num_silos, 1.0 / data.num_silos)
            if self._surrogates is not None:
                check_surrogates(self._surrogates, data.num_silos, pot.global_dim)
            if self._batch_size is not None and not self._replace:
                if self._batch_size > min(data.sizes):
                    raise ValueError(
                        f"batch_size={self._batch_size} exceeds the smallest silo "
                        f"({min(data.sizes)} units): draw with replace=True or use a "
                        "smaller batch."
                    )
            cfg = SGLDConfig(
                self._step_size,
                self._tau,
                jnp.asarray(f),
                self._alpha,
                None
                if self._surrogates is None
                else ChainSurrogates.of(self._surrogates, f, self._alpha),
                self._batch_size,
                self._replace,
            )
            self._built[layout] = (pot, cfg)
        return self._built[layout]

    def potential(self, data: Any) -> FederatedPotential:
        """The model's :class:`~numpyro_fed.potentials.FederatedPotential` on ``data``."""
        return self._setup(data)[0]

    def config(self, data: Any) -> SGLDConfig:
        """The chain's :class:`SGLDConfig` on ``data``."""
        return self._setup(data)[1]

    # -------------------------------------------------------------- NumPyro API
    @property
    def model(self) -> Callable:
        """The model on pooled data, ``model(data)``, as ArviZ expects."""
        return pooled_model(self._model)

    @property
    def default_fields(self) -> tuple[str, ...]:
        return ("z",)

    def init(
        self, rng_key, num_warmup, init_params=None, model_args=(), model_kwargs=None
    ):
        """
        :param jax.random.key rng_key: the chain's key (or one key per chain for
            ``chain_method="vectorized"``).
        :param int num_warmup: burn-in steps (no adaptation: counted like samples).
        :param dict init_params: an unconstrained starting position (global sites;
            local sites stacked ``(J, P, ...)``), or ``None`` for ``init_strategy``.
        :return: the initial :class:`SGLDState`.
        """
        del num_warmup
        data = self._data(model_args, model_kwargs)
        pot, cfg = self._setup(data)

        def one(key, z=None):
            init_key, chain_key = jax.random.split(key)
            if z is None:
                z = pot.init_position(init_key, data, self._init_strategy)
            return init(pot, z, chain_key)

        sample_fn = lambda state, d: step(pot, cfg, state, silo_data_of(d))
        if is_prng_key(rng_key):
            state = one(rng_key, init_params)
            self._sample_fn = sample_fn
        else:
            state = (
                jax.vmap(one)(rng_key, init_params)
                if init_params is not None
                else (jax.vmap(one)(rng_key))
            )
            self._sample_fn = jax.vmap(sample_fn, in_axes=(0, None))
        return state

    def sample(
        self, state: SGLDState, model_args: tuple, model_kwargs: dict
    ) -> SGLDState:
        """One Langevin step (:func:`step`)."""
        return self._sample_fn(state, self._data(model_args, model_kwargs))

    def postprocess_fn(self, model_args: tuple, model_kwargs: dict) -> Callable:
        """Unconstrained position -> constrained sites, local sites in pooled order."""
        if not model_args:
            return identity
        data = self._data(model_args, model_kwargs)
        pot = self._setup(data)[0]

        def constrain(z: dict) -> dict:
            z_global, z_local = pot.split(z)
            values = pot.constrain(z_global)
            values.update(data.gather_units(pot.constrain(z_local)))
            return values

        return constrain

    def get_diagnostics_str(self, state: SGLDState) -> str:
        return f"silo {int(state.silo)}, h={float(self._step_size(state.step)):.2e}"

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_sample_fn"] = None
        state["_built"] = {}
        return state

    # --------------------------------------------------------------- protocol
    def run_protocol(
        self,
        rng_key: jax.Array,
        data: Any,
        num_rounds: int,
        *,
        init_params: dict | None = None,
    ) -> ProtocolResult:
        """
        Run the chain as messages between a server and the silos under the sequential
        runtime: each round the server sends the chain (global position, step counter,
        key) to one silo, which returns its ``tau``-step trajectory. Starting from the
        same ``rng_key`` it reproduces ``MCMC(kernel, num_warmup=0, num_samples=
        num_rounds * tau).run(rng_key, data)`` draw for draw on the global sites.

        :param jax.random.key rng_key: the chain's key (as given to ``MCMC.run``).
        :param FederatedData data: the silos' data.
        :param int num_rounds: chain handoffs.
        :param dict init_params: optional unconstrained starting position.
        :rtype: ProtocolResult
        """
        from numpyro_fed.runtime import sequential_round

        if not isinstance(num_rounds, int) or num_rounds < 1:
            raise ValueError(f"num_rounds must be a positive int, got {num_rounds!r}.")
        pot, cfg = self._setup(data)
        algorithm = fsgld(pot, cfg, self._init_strategy)
        jitted = FederatedAlgorithm(*(jax.jit(f) for f in algorithm))
        first = self.init(rng_key, 0, init_params, (data,), {})
        z_global, z_local = pot.split(first.z)
        zero = jnp.zeros((), jnp.int32)
        server = FSGLDServerState(
            z_global, zero, _choose_silo(cfg, first.rng_key, zero), first.rng_key
        )
        silos = FSGLDSiloState(z_local)
        silo_data = silo_data_of(data)
        keys = jax.random.split(jax.random.key(0), data.num_silos)
        trajectories, down, up = [], 0, 0
        for _ in range(num_rounds):
            participating = np.arange(data.num_silos) == int(server.silo)
            down += _nbytes(jitted.server_message(server, keys[0]))
            server, silos, trajectory = sequential_round(
                jitted, server, silos, silo_data, keys[0], keys, participating
            )
            up += _nbytes(FSGLDSiloMessage(trajectory, server.step))
            trajectories.append(trajectory)
        steps = num_rounds * cfg.tau
        samples = jax.tree.map(lambda *xs: jnp.concatenate(xs), *trajectories)
        surrogate_bytes = 0
        if cfg.surrogates is not None:
            one = (cfg.surrogates.precision[0], cfg.surrogates.shift[0])
            surrogate_bytes = 2 * data.num_silos * _nbytes(one)  # up once, product down
        stats = CommStats(
            rounds=num_rounds,
            steps=steps,
            surrogate_messages=0 if cfg.surrogates is None else data.num_silos,
            surrogate_bytes=surrogate_bytes,
            server_to_silo_messages=num_rounds,
            server_to_silo_bytes=down,
            silo_to_server_messages=num_rounds,
            silo_to_server_bytes=up,
        )
        return ProtocolResult(pot.constrain(samples), server, silos, stats)


class DSGLD(FSGLD):
    """
    Distributed SGLD (Ahn et al. 2014; El Mekkaoui et al., Eqs. 3-4): :class:`FSGLD`
    without the conducive gradient.

    :param callable model: a federated model.
    :param step_size: :math:`h` or a callable ``t -> h_t``.
    :param int tau: local steps per visit.
    :param silo_probs: :math:`f` (default uniform).
    :param int batch_size: minibatch size per silo (default: the whole silo).
    :param bool replace: draw minibatches with replacement.
    :param callable init_strategy: NumPyro init strategy.

    **Example:**

    .. doctest::

        >>> import numpyro_fed as nf
        >>> def model(y): ...
        >>> nf.DSGLD(model, 1e-3, tau=0)
        Traceback (most recent call last):
        ...
        ValueError: tau (local steps per visit) must be an int >= 1, got 0.
    """

    def __init__(
        self,
        model: Callable,
        step_size: Any,
        tau: int = 1,
        silo_probs: Any = None,
        batch_size: int | None = None,
        *,
        replace: bool = True,
        init_strategy: Callable = init_to_uniform,
    ) -> None:
        super().__init__(
            model,
            step_size,
            None,
            tau,
            silo_probs,
            0.0,
            batch_size,
            replace=replace,
            init_strategy=init_strategy,
        )
