# Two commands for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: install serve test bench check-container clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Serving needs only the package; the test extras come with `make test`.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e .
	touch $(STAMP)

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -q -e '.[test]'
	touch $(TEST_STAMP)

install: $(TEST_STAMP)

serve: $(STAMP)
	$(BIN)/rnnserve serve $(ARGS)

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/rnnserve bench $(ARGS)

check-container:
	bash .ci/checks.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
