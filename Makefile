# numpyro-fed: `make demo` and `make test` set up .venv (Python >= 3.12) when missing.
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export JAX_PLATFORMS := cpu

.PHONY: venv test test-slow demo bench lint clean

$(PY):
	@interp=$$(bash scripts/find-python.sh) || exit 1; \
	echo "creating $(VENV) with $$interp"; \
	"$$interp" -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[dev,examples]"
	@touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

demo: $(STAMP)
	$(PY) examples/quickstart.py

bench: $(STAMP)
	$(PY) benchmarks/sfvi_round.py

lint: $(STAMP)
	$(VENV)/bin/ruff check numpyro_fed tests examples benchmarks

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
