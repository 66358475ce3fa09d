# Two commands for a fresh machine: `make serve` and `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install serve test bench check-container clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

serve: $(STAMP)
	$(BIN)/rnnserve serve $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(BIN)/rnnserve bench $(ARGS)

check-container:
	bash .ci/checks.sh

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
