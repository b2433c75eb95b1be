# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Timing shared by the round benchmarks."""

import datetime
import os
import platform
import time

import jax
import numpy as np
import numpyro


def interleaved_times(steps, states, repeats, statistic=np.median):
    """``statistic`` (default: the median) of the times of each
    ``step(state) -> (state, out)``, after one compile-and-warm-up call each; the steps
    are timed alternately so that load on the machine affects all of them alike."""
    states = list(states)
    for i, step in enumerate(steps):
        states[i], out = step(states[i])
        jax.block_until_ready((states[i], out))
    times = [[] for _ in steps]
    for _ in range(repeats):
        for i, step in enumerate(steps):
            start = time.perf_counter()
            states[i], out = step(states[i])
            jax.block_until_ready((states[i], out))
            times[i].append(time.perf_counter() - start)
    return [float(statistic(t)) for t in times]


def machine_meta() -> dict:
    """What a benchmark's JSON records of the machine, the library versions and the
    date of the run (UTC; docs/results.md shows it)."""
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).date().isoformat(),
        "jax": jax.__version__,
        "numpyro": numpyro.__version__,
        "machine": platform.machine(),
        "jax_devices": jax.device_count(),
        "cpu_count": os.cpu_count(),
    }
