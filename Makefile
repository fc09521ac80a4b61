# Two commands do all set-up: `make demo` runs the main job (the quick benchmark suite and its
# report), `make test` runs the tests.
# Both create .venv on first use and reinstall only when pyproject.toml changes.
PYTHON ?= python3.11
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test test-slow clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test,hf,text]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/attnzoo bench suite --out runs/suite --report report

# Lint and format checks first (ruff, settings in pyproject.toml): seconds, and CI enforces them.
test: $(STAMP)
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts
	$(BIN)/python -m pytest

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

clean:
	rm -rf $(VENV) build src/*.egg-info runs report
