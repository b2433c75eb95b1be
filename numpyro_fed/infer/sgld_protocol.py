# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""What :meth:`~numpyro_fed.FSGLD.run_protocol` returns: the chain run as messages
between a server and the silos, and what those messages cost."""

from typing import NamedTuple

from numpyro_fed.algorithms.sgld import FSGLDServerState, FSGLDSiloState

__all__ = ["CommStats", "ProtocolResult"]


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
