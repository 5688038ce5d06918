# The whole set-up on a fresh machine: `make serve` or `make test`.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: serve test install install-dev lint clean e2e-clients browser screenshot

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# uv installs the same packages as pip from the same index, in a fifth of the time (a
# target of its own, so a venv made before it gets it too).
$(BIN)/uv: | $(BIN)/python
	$(BIN)/python -m pip install --quiet uv

$(VENV)/.installed: pyproject.toml | $(BIN)/uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e .
	touch $@

$(VENV)/.installed-dev: pyproject.toml | $(BIN)/uv
	$(BIN)/uv pip install --quiet --python $(BIN)/python -e ".[dev]"
	touch $@ $(VENV)/.installed

install: $(VENV)/.installed

install-dev: $(VENV)/.installed-dev

serve: $(VENV)/.installed
	$(BIN)/mlxserve serve --demo --host $(HOST) --port $(PORT)

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check mlxserve tests scripts
	$(BIN)/ruff format --check mlxserve tests scripts
	$(BIN)/mypy mlxserve

# The operator page's tests run in the system's headless Chromium (installed here if missing).
browser:
	bash scripts/install-browser.sh

# Three workers on two cores: the tests keep both busy (two workers left a third of the
# CPU idle). The mlx.launch tests are one module, so one worker runs them one after
# another, first (tests/conftest.py orders them first; --no-loadscope-reorder keeps
# that order instead of xdist's most-tests-first, which left them running alone last).
# Bytecode is written even where the environment says not to (PYTHONDONTWRITEBYTECODE=1, as
# on this machine): the suite starts about fifty Python processes (workers, servers, ranks)
# on a venv uv installs without bytecode, and each compiled every module it imports
# (transformers, mlx-lm, ...) again, about 2 s of CPU apiece.
test: lint browser
	PYTHONDONTWRITEBYTECODE= MLXSERVE_REQUIRE_BROWSER=1 $(BIN)/pytest -n 3 --dist loadfile --no-loadscope-reorder --durations=25

# docs/dashboard.png, the README's picture of the operator page, from a live server under load.
screenshot: $(VENV)/.installed-dev browser
	$(BIN)/python scripts/dashboard_screenshot.py docs/dashboard.png

# The real agent clients (installed from npm) against a scripted checkpoint; not part of CI.
e2e-clients: $(VENV)/.installed-dev
	bash e2e/claude_code.sh
	bash e2e/claude_code_images.sh
	bash e2e/codex.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
