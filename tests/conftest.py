# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
import os

import jax
import pytest

# Tests run on CPU; the suite turns float64 on once for the whole session so that
# exactness checks can compare to 1e-10 (this mirrors NumPyro's JAX_ENABLE_X64 job).
jax.config.update("jax_platform_name", "cpu")
if os.environ.get("NUMPYRO_FED_X64", "1") == "1":
    jax.config.update("jax_enable_x64", True)


@pytest.fixture
def enable_x64():
    """Float64 for the duration of a test (already on by default in this suite)."""
    previous = jax.config.jax_enable_x64
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", previous)
