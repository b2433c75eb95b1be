# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
""":meth:`~numpyro_fed.FSGLD.run_protocol`: the chain run as messages between a
server and the silos under the sequential runtime (:func:`run_chain`), what it
returns, and what those messages cost."""

from typing import Any, NamedTuple
import warnings

import jax
import jax.numpy as jnp
import numpy as np

from numpyro_fed.algorithms.sgld import FSGLDServerState, FSGLDSiloState
from numpyro_fed.potentials import FederatedPotential
from numpyro_fed.protocol import FederatedAlgorithm, silo_data_of
from numpyro_fed.runtime import round_bytes, sequential_round
from numpyro_fed.runtime.accounting import nbytes

__all__ = ["CommStats", "ProtocolResult", "run_chain"]


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
    - **server_state** - the final
      :class:`~numpyro_fed.algorithms.sgld.FSGLDServerState`.
    - **silo_states** - the final
      :class:`~numpyro_fed.algorithms.sgld.FSGLDSiloState`, stacked by silo.
    - **stats** - :class:`CommStats`.
    """

    samples: dict
    server_state: FSGLDServerState
    silo_states: FSGLDSiloState
    stats: CommStats


def run_chain(
    name: str,
    algorithm: FederatedAlgorithm,
    pot: FederatedPotential,
    first: Any,
    data: Any,
    num_rounds: int,
    surrogates: Any,
    tau: int,
) -> ProtocolResult:
    """
    The body of :meth:`~numpyro_fed.FSGLD.run_protocol`: ``num_rounds`` rounds of
    :func:`~numpyro_fed.runtime.sequential_round` from the kernel's initial state
    ``first`` (:class:`~numpyro_fed.infer.mcmc.SGLDState`). The runtime drops a
    non-finite trajectory (the chain stays put, its counter moves on), so a chain
    that diverges repeats its position instead of turning NaN: it warns after the
    run, naming the first such round, its silo and step, and how many there were.

    :param str name: the kernel's name, for the warning.
    :param FederatedAlgorithm algorithm: the chain (jitted) with ``tau`` steps per
        contact.
    :param FederatedPotential pot: the model's potentials.
    :param first: the initial state.
    :param FederatedData data: the silos' data.
    :param int num_rounds: chain handoffs.
    :param surrogates: the silos' surrogates (``None`` for DSGLD), for the bytes.
    :param int tau: steps per contact.
    :rtype: ProtocolResult
    """
    z_global, z_local = pot.split(first.z)
    server = FSGLDServerState(z_global, first.step, first.silo, first.rng_key)
    silos = FSGLDSiloState(z_local)
    silo_data = silo_data_of(data, pot.nested)
    # The server's steps ignore their key; each silo draws from its own key
    # folded with the step counter, so one key per silo serves every round.
    server_key, silo_keys = first.rng_key, first.silo_keys
    sizes = round_bytes(algorithm, server, silos, silo_data, server_key, silo_keys)
    trajectories, dropped = [], []
    for r in range(num_rounds):
        step, silo = int(server.step), int(server.silo)
        server, silos, info = sequential_round(
            algorithm, server, silos, silo_data, server_key, silo_keys
        )
        trajectories.append(info.trajectory)
        if np.any(info.rejected):
            dropped.append((r, silo, step))
    if dropped:
        r, silo, step = dropped[0]
        warnings.warn(
            f"{name}: the Langevin trajectory left finite values on {len(dropped)} of "
            f"{num_rounds} rounds, first on round {r} (silo {silo}, from step {step}); "
            "the runtime dropped those replies and the chain repeated its position. "
            "Lower step_size; for FSGLD, bound the conducive gradient "
            "(conducive_radius).",
            RuntimeWarning,
            stacklevel=3,
        )
    samples = jax.tree.map(lambda *xs: jnp.concatenate(xs), *trajectories)
    surrogate_bytes, uploads = 0, 0
    if surrogates is not None:
        one = jax.tree.map(lambda x: x[0], surrogates)
        surrogate_bytes = 2 * data.num_silos * nbytes(one)  # up once, product down
        uploads = data.num_silos
    stats = CommStats(
        rounds=num_rounds,
        steps=num_rounds * tau,
        surrogate_messages=uploads,
        surrogate_bytes=surrogate_bytes,
        server_to_silo_messages=num_rounds,
        server_to_silo_bytes=num_rounds * int(sizes.down),
        silo_to_server_messages=num_rounds,
        silo_to_server_bytes=num_rounds * int(sizes.reply),
    )
    return ProtocolResult(pot.constrain(samples), server, silos, stats)
