# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Federated inference algorithms, each a factory of pure functions plus a wrapper."""

from numpyro_fed.algorithms.fedgvi import fedgvi
from numpyro_fed.algorithms.pvi import pvi
from numpyro_fed.algorithms.sfvi import (
    SFVIInfo,
    SFVIServerMessage,
    SFVIServerState,
    SFVISiloMessage,
    SFVISiloState,
    sfvi,
)
from numpyro_fed.algorithms.sfvi_avg import (
    SFVIAvgServerMessage,
    SFVIAvgServerState,
    SFVIAvgSiloMessage,
    SFVIAvgSiloState,
    sfvi_avg,
)
from numpyro_fed.algorithms.sgld import (
    DSGLD,
    FSGLD,
    CommStats,
    SGLDState,
    annealed_step_size,
    fsgld,
)
from numpyro_fed.algorithms.vertical_sfvi import RowIndexMismatchError, vertical_sfvi

__all__ = [
    "fedgvi",
    "CommStats",
    "DSGLD",
    "FSGLD",
    "SGLDState",
    "annealed_step_size",
    "fsgld",
    "pvi",
    "SFVIAvgServerMessage",
    "SFVIAvgServerState",
    "SFVIAvgSiloMessage",
    "SFVIAvgSiloState",
    "sfvi_avg",
    "SFVIInfo",
    "SFVIServerMessage",
    "SFVIServerState",
    "SFVISiloMessage",
    "SFVISiloState",
    "sfvi",
    "RowIndexMismatchError",
    "vertical_sfvi",
]
