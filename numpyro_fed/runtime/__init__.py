# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Runtimes: how the pure functions of any algorithm are scheduled."""

from numpyro_fed.runtime.accounting import RoundBytes, round_bytes, silo_bytes
from numpyro_fed.runtime.contact import contact_round
from numpyro_fed.runtime.events import EventSchedule, event_round, event_schedule
from numpyro_fed.runtime.sequential import sequential_round
from numpyro_fed.runtime.sharded import (
    sharded_group_round,
    sharded_round,
    silo_mesh,
)
from numpyro_fed.runtime.simulate import simulate_round

__all__ = [
    "EventSchedule",
    "RoundBytes",
    "contact_round",
    "event_round",
    "event_schedule",
    "round_bytes",
    "silo_bytes",
    "sequential_round",
    "sharded_group_round",
    "sharded_round",
    "silo_mesh",
    "simulate_round",
]
