# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Runtimes: how the pure functions of an algorithm are scheduled."""

from numpyro_fed.runtime.sequential import sequential_round
from numpyro_fed.runtime.simulate import simulate_round

__all__ = ["sequential_round", "simulate_round"]
