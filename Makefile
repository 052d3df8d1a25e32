# kvhost: `make test` sets up .venv and runs the suite; nothing else needs installing by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU build of torch that pip takes from this machine's disk; override on a GPU runner,
# e.g. `make test TORCH=torch` there.
TORCH ?= torch==2.13.0

.PHONY: setup test lint format demo bench kernel-choice mutation clean

setup: $(VENV)/.installed

# pip's and setuptools' chatter goes to $(VENV)/install.log, shown only if a step fails.
QUIETLY = > $(VENV)/install.log 2>&1 || { cat $(VENV)/install.log; exit 1; }

$(VENV)/.installed: pyproject.toml
	@echo "setting up $(VENV) (torch, numba, triton, NIXL, test tools; a few minutes the first time)"
	@$(PYTHON) -m venv $(VENV)
	@$(PY) -m pip install --upgrade pip $(QUIETLY)
	@$(PY) -m pip install "$(TORCH)" $(QUIETLY)
	@$(PY) -m pip install -e '.[test]' $(QUIETLY)
	@touch $@

# The result, and one line per kind of skipped test (a device absent here); -rs lists them all.
test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy

demo: setup
	$(VENV)/bin/kvhost demo

bench: setup
	$(VENV)/bin/kvhost bench

# numba against the same kernel in C++ (needs g++) and torch ops; see docs/performance.md.
kernel-choice: setup
	$(PY) experiments/cpu_kernel_choice/compare.py --requests 1,4,16,64,256

# Mutation testing of the core (ci/mutation.py, report in .mutation/report.md): hours on two
# cores, so not part of `make test` or CI. MUTATION_ARGS="--module kvhost/memory.py" narrows it.
mutation: setup
	$(PY) ci/mutation.py $(MUTATION_ARGS)

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis .mutation
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
