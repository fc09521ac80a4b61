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

# The main job, about 8 minutes on 2 quiet CPU cores (7 min 31 s measured from a fresh clone):
# speed and memory of every mechanism at
# N = 1K and 4K (forward+backward, vs SDPA), a short ListOps run per family, and report/index.html
# with the committed results of benchmarks/ beside the fresh ones. Stage times: runs/suite/quick/stages.jsonl.
demo: $(STAMP)
	$(BIN)/attnzoo bench suite --out runs/suite --report report --committed benchmarks

# Lint and format checks first (ruff, settings in pyproject.toml): seconds, and CI enforces them.
test: $(STAMP)
	$(BIN)/ruff check src tests scripts
	$(BIN)/ruff format --check src tests scripts
	$(BIN)/python -m pytest

test-slow: $(STAMP)
	$(BIN)/python -m pytest -m slow

clean:
	rm -rf $(VENV) build src/*.egg-info runs report
