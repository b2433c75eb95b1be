# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
import os

# The suite compiles many small programs and runs each briefly: cheaper LLVM passes
# cut its wall time by about a quarter (set NUMPYRO_FED_FAST_COMPILE=0 to keep them).
if os.environ.get("NUMPYRO_FED_FAST_COMPILE", "1") == "1":
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
    ).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

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


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop JAX's compiled programs after each test module. A worker compiles
    thousands of programs over the run, each mapping memory; kept alive they reached
    the kernel's memory-map limit (65,530 here) late in the run, and XLA crashed
    while compiling."""
    yield
    jax.clear_caches()
