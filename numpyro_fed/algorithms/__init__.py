# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Federated inference algorithms, each a factory of pure functions plus a wrapper."""

from numpyro_fed.algorithms._runner import RunResult
from numpyro_fed.algorithms.sfvi import (
    SFVIInfo,
    SFVIServerMessage,
    SFVIServerState,
    SFVISiloMessage,
    SFVISiloState,
    sfvi,
)
from numpyro_fed.algorithms.sfvi_wrapper import SFVI, SFVIParams, SFVIState

__all__ = [
    "SFVI",
    "SFVIInfo",
    "SFVIParams",
    "SFVIServerMessage",
    "SFVIServerState",
    "SFVISiloMessage",
    "SFVISiloState",
    "SFVIState",
    "RunResult",
    "sfvi",
]
