# Two commands for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
KERNELS_STAMP := $(VENV)/.kernels-built

.PHONY: install serve test test-fast lint bench check-container clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Serving needs only the package; the test extras come with `make test`.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test]'
	touch $(TEST_STAMP)

# The CPU decode kernels and the shipped models' compiled decode steps, built ahead so that a server runs no
# compiler beside its requests (server/prebuild.py). Without a C++ compiler the server decodes with PyTorch's
# operators, so a failure here is reported, not fatal.
$(KERNELS_STAMP): $(STAMP) $(wildcard model/*.py model/*/*.py model/*/*/*.py) \
		$(wildcard model/kernels/*.cpp) $(wildcard weights/*.safetensors)
	$(BIN)/rnnserve build-kernels --weights weights \
		|| echo "make: building the CPU kernels ahead failed (see above); the server will decode without them"
	touch $(KERNELS_STAMP)

install: $(TEST_STAMP) $(KERNELS_STAMP)

serve: $(STAMP) $(KERNELS_STAMP)
	$(BIN)/rnnserve serve $(ARGS)

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

# The quick tier while working: everything but the tests marked slow (servers, browsers, Ray, compiles,
# trainings; tests/conftest.py lists them). CI runs `make test`.
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -q -m "not slow" $(PYTEST_ARGS)

# ruff: pyflakes and pycodestyle's errors, and the formatting; mypy: the types of server/engine/ and model/, both
# strict (configured in pyproject.toml). CI runs it before the tests.
lint: $(TEST_STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/rnnserve bench $(ARGS)

check-container:
	bash .ci/checks.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
