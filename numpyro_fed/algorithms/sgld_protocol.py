# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""FSGLD and DSGLD as messages: the chain handoff between a server and the silos.

Each round the server sends the chain (global position, step counter, key) to the silo
:math:`c_r` it drew; the silo takes ``tau`` steps of
:func:`~numpyro_fed.algorithms.sgld_step.local_step` on its own data and local sites,
and returns the trajectory of the global sites. The surrogates' natural parameters
travel once, before sampling; data and local latent sites never leave a silo.
"""

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from numpyro.infer.initialization import init_to_uniform

from numpyro_fed.algorithms.sgld_step import (
    SGLDConfig,
    SGLDState,
    choose_silo,
    local_step,
)
from numpyro_fed.potentials import FederatedPotential
from numpyro_fed.protocol import (
    FederatedAlgorithm,
    Message,
    SiloData,
    jit_algorithm,
    silo_data_of,
)

__all__ = [
    "CommStats",
    "FSGLDServerMessage",
    "FSGLDServerState",
    "FSGLDSiloMessage",
    "FSGLDSiloState",
    "ProtocolResult",
    "fsgld",
    "run_protocol",
]


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
            z_global, zero, choose_silo(cfg, chain_key, zero), chain_key
        )

    def init_silo(key: jax.Array, data: SiloData) -> FSGLDSiloState:
        return FSGLDSiloState(pot.init_local(key, data.arrays, init_strategy))

    def server_message(state: FSGLDServerState, key: jax.Array) -> Message:
        del key
        return Message(
            FSGLDServerMessage(state.z_global, state.step, state.silo, state.rng_key)
        )

    def silo_step(message, state: FSGLDSiloState, data: SiloData, key: jax.Array):
        del key  # the chain's key travels with it
        message = message.broadcast

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
        silo = choose_silo(cfg, state.rng_key, reply.step)
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


def run_protocol(
    pot: FederatedPotential,
    cfg: SGLDConfig,
    first: SGLDState,
    data: Any,
    num_rounds: int,
    init_strategy=init_to_uniform,
) -> ProtocolResult:
    """
    Run the chain as messages under the sequential runtime, from the kernel's initial
    state ``first`` (see :meth:`~numpyro_fed.FSGLD.run_protocol`), counting messages
    and bytes.

    :param FederatedPotential pot: the model's potentials.
    :param SGLDConfig cfg: the chain's settings.
    :param SGLDState first: the initial chain state (its key and position).
    :param FederatedData data: the silos' data.
    :param int num_rounds: chain handoffs.
    :rtype: ProtocolResult
    """
    from numpyro_fed.runtime import sequential_round

    if not isinstance(num_rounds, int) or num_rounds < 1:
        raise ValueError(f"num_rounds must be a positive int, got {num_rounds!r}.")
    algorithm = fsgld(pot, cfg, init_strategy)
    jitted = jit_algorithm(algorithm)
    z_global, z_local = pot.split(first.z)
    zero = jnp.zeros((), jnp.int32)
    server = FSGLDServerState(
        z_global, zero, choose_silo(cfg, first.rng_key, zero), first.rng_key
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
