# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
import atexit
import os
import shutil
import tempfile
import uuid

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

# Many tests build the same programs again (a new model or algorithm object is a new
# jit cache, and the fixture below drops the in-memory caches after each module): an
# on-disk compilation cache, deleted at the end of the run, turns those recompilations
# into loads (about a quarter less CPU time on the algorithm tests). The two workers
# of an xdist run share one (they compiled 1,578 of their 9,395 programs both), so
# its writes are made atomic: a worker never reads the other's half-written entry.
# NUMPYRO_FED_TEST_CACHE=0 compiles everything afresh.
_CACHE = os.environ.get("NUMPYRO_FED_TEST_CACHE", "1") == "1"


def _shared_cache_dir(run_id: str) -> str:
    return os.path.join(tempfile.gettempdir(), f"numpyro-fed-jax-cache-{run_id}")


def _atomic_put(self, key: str, value: bytes) -> None:
    """``LRUCache.put`` (eviction off, as here) writing a whole file or none."""
    path = os.path.join(str(self.path), key + lru_cache._CACHE_SUFFIX)
    if os.path.exists(path):
        return
    partial = f"{path}.{os.getpid()}.partial"
    with open(partial, "wb") as f:
        f.write(value)
    os.replace(partial, path)


if _CACHE:
    from jax._src import lru_cache

    _run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")  # set in xdist's workers
    if _run_id and hasattr(lru_cache.LRUCache, "put"):
        _cache_dir = _shared_cache_dir(_run_id)
        os.makedirs(_cache_dir, exist_ok=True)
        lru_cache.LRUCache.put = _atomic_put  # the controller deletes the folder
    else:
        _cache_dir = tempfile.mkdtemp(prefix="numpyro-fed-jax-cache-")
        atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
    jax.config.update("jax_compilation_cache_dir", _cache_dir)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def pytest_configure(config):
    """In the controller of an xdist run, name the run, so that its workers find
    their shared compilation cache by the name (xdist passes it on)."""
    if _CACHE and not hasattr(config, "workerinput"):
        if getattr(config.option, "numprocesses", None) and not getattr(
            config.option, "testrunuid", None
        ):
            config.option.testrunuid = uuid.uuid4().hex


def pytest_unconfigure(config):
    """In the controller, delete the workers' shared compilation cache."""
    run_id = getattr(config.option, "testrunuid", None)
    if _CACHE and run_id and not hasattr(config, "workerinput"):
        shutil.rmtree(_shared_cache_dir(run_id), ignore_errors=True)


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
