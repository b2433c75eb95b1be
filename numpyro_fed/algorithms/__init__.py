# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Federated inference algorithms, each a factory of pure functions plus a wrapper."""

from numpyro_fed.algorithms.fedgvi import FedGVI
from numpyro_fed.algorithms.pvi_wrapper import (
    PVI,
    InvalidCavity,
    PVIParams,
    PVIResult,
    PVIState,
)
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
from numpyro_fed.algorithms.sgld import annealed_step_size, dsgld, fsgld
from numpyro_fed.algorithms.vertical import (
    RowIndexMismatchError,
    VerticalParams,
    VerticalSFVI,
    VerticalSFVIState,
    vertical_sfvi,
)

__all__ = [
    "FedGVI",
    "annealed_step_size",
    "dsgld",
    "fsgld",
    "InvalidCavity",
    "PVI",
    "PVIParams",
    "PVIResult",
    "PVIState",
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
    "VerticalParams",
    "VerticalSFVI",
    "VerticalSFVIState",
    "vertical_sfvi",
]
