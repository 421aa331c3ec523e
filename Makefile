# gradtrace developer commands. Each target installs what it needs into .venv on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=

.PHONY: install test lint demo bench clean

$(STAMP): pyproject.toml requirements-dev.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(BIN)/python -m pip install -q --disable-pip-version-check -r requirements-dev.txt
	$(BIN)/python -m pip install -q --disable-pip-version-check --no-deps -e .
	@# torchvision/torchaudio from PyPI do not match the CPU torch and break transformers imports
	-$(BIN)/python -m pip uninstall -q -y torchvision torchaudio 2>/dev/null
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest -q $(PYTEST_ARGS)

lint: $(STAMP)
	$(BIN)/ruff check gradtrace tests bench examples

demo: $(STAMP)
	$(BIN)/gradtrace demo

clean:
	rm -rf $(VENV) .pytest_cache build *.egg-info
