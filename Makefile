# The two set-up commands: `make serve` and `make test`. Both install into .venv.
PY := .venv/bin/python
PIP := $(PY) -m pip

.PHONY: serve test test-full install install-dev lint format proto

.venv/bin/python:
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip

# the install steps live in scripts/install.sh (the Docker images run it too)
.venv/.installed: .venv/bin/python pyproject.toml scripts/install.sh
	scripts/install.sh .venv --editable
	touch $@

.venv/.installed-dev: .venv/.installed
	scripts/install.sh .venv --editable --extra dev
	touch $@

install: .venv/.installed
install-dev: .venv/.installed-dev

serve: install
	$(PY) -m jaxpaged.serve $(ARGS)

# Two pytest workers (pytest-xdist; a test module stays on one worker, so its shared engines
# are built once): most of a cold run is XLA compiling, one program per process at a time,
# so two workers on two cores finish well before one process (figures in
# docs/development.md). TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
test: install-dev
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS)

# also the long matrices (JAXPAGED_TEST_FULL=1: docs/development.md)
test-full:
	JAXPAGED_TEST_FULL=1 $(MAKE) test

lint: install-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install-dev
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

proto: install-dev
	PYTHON=$(PY) serving/regen_proto.sh
