# numpyro-fed: `make demo` and `make test` set up .venv (Python >= 3.12) when missing.
# The interpreter is found by scripts/find-python.sh; override with PYTHON=/path/to/python3.12.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

export JAX_PLATFORMS := cpu
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# Flower offline: no telemetry, no update check.
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_DISABLE_UPDATE_CHECK := 1

.DELETE_ON_ERROR:
.PHONY: venv install test test-slow demo bench reference lint docs clean

# Create the virtual environment. A leftover .venv whose python no longer runs (or is
# older than 3.12) is rebuilt from scratch.
$(PY):
	@interp=$$(bash scripts/find-python.sh) || exit 1; \
	echo "creating $(VENV) with $$interp ($$("$$interp" -c 'import sys; print(sys.version.split()[0])'))"; \
	rm -rf $(VENV); \
	"$$interp" -m venv $(VENV) || { rm -rf $(VENV); exit 1; }

# Install the package with its extras; redone when pyproject.toml changes.
$(STAMP): $(PY) pyproject.toml
	@$(PY) -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null || { \
	  echo "$(VENV) does not run Python >= 3.12; run 'make clean' and try again." >&2; exit 1; }
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev,examples,flower,docs]"
	@touch $@

venv install: $(STAMP)

# Two workers (the CI machine has 2 cores); a file's tests stay on one worker so
# module-scoped fixtures are built once. A worker that crashes is not replaced:
# xdist 3.8 hangs for good when it replaces one under --dist loadfile
# (pytest-dev/pytest-xdist#784), so a crash ends the run with a failure at once.
XDIST := -n 2 --dist loadfile --max-worker-restart 0
test: $(STAMP)
	$(PY) -m pytest -q $(XDIST) --durations=25

test-slow: $(STAMP)
	$(PY) -m pytest -q $(XDIST) -m slow

# Flower's simulation engine: every algorithm against the one-process runtimes, and
# nodes that crash, straggle, send NaN or malformed replies and resume (two
# simulations, about two minutes); the codec and remote halves are in the default run.
.PHONY: test-flower
test-flower: $(STAMP)
	$(PY) -m pytest -q -m flower tests/runtime

# Every example with --quick, as a subprocess (tests/examples); the examples are one
# test file, so its tests are spread over the two workers one by one.
.PHONY: test-examples
test-examples: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist load -m examples tests/examples

demo: $(STAMP)
	$(PY) examples/quickstart.py

# Every benchmark with short settings, one table of ratios (benchmarks/results/quick/).
bench: $(STAMP)
	$(PY) benchmarks/run_all.py

# Build the wheel, install it in a fresh venv (from the index) and run the quickstart.
.PHONY: wheel-check
wheel-check:
	bash scripts/check-wheel.sh

# Every algorithm on every published reference posterior, after a NUTS check of each
# port (numpyro_fed.reference; slow: 30-40 minutes on 2 cores). One table, and
# benchmarks/results/reference/suite.json.
reference: $(STAMP)
	$(PY) benchmarks/reference_suite.py

# The site (docs/_build/html): warnings are errors, every tutorial is executed on the
# CPU. Outputs are cached in docs/_build/.jupyter_cache by page text, so a rebuild
# re-runs only the pages that changed: after a library change, rm -rf docs/_build to
# re-run them all (a fresh clone always does). -j auto executes pages in parallel.
docs: $(STAMP)
	$(PY) -m sphinx -W --keep-going -j auto -b html docs docs/_build/html
	$(PY) -m pytest -q -n 2 -m docs tests/test_doc_snippets.py

lint: $(STAMP)
	$(VENV)/bin/ruff check numpyro_fed tests examples benchmarks
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache docs/_build
	find . -path ./.git -prune -o -type d -name __pycache__ -prune -exec rm -rf {} +
