# The two commands: `make up` (set up, then run the mesh) and `make test`
# (set up, then run every test). Setup is idempotent and skipped when done.
# `make check` is the fast tier: lint, types, shape and the unit tests.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvmesh-setup-done

.PHONY: up test check setup lint protos render dashboards images clean

up: setup
	$(BIN)/kvmesh up $(ARGS)

# Two pytest runs (scripts/run_tests.py): the tiers that start no process
# (unit, deploy, observability) on two workers, then the rest one at a time.
# PYTEST_ARGS go to both; a `-m` in them narrows each.
test: setup
	$(BIN)/python scripts/run_tests.py $(PYTEST_ARGS)

# The `unit` tier (pyproject.toml's markers; tests/conftest.py gives each test
# its tier by folder): ruff, mypy and the shape check (tests/unit/test_code_*.py)
# and every in-process test -- no mesh, no root, no vLLM. Under 2 minutes on 2 cores:
# two pytest workers (pytest-xdist), a test module's tests in one worker (its
# module fixtures are made once), and mypy filling its cache meanwhile, so the
# gate (test_code_gates.py, collected last) finds it warm instead of running cold.
check: setup
	$(BIN)/python scripts/typecheck.py >/dev/null 2>&1 & \
	$(BIN)/python -m pytest -m unit -n 2 --dist loadfile $(PYTEST_ARGS); status=$$?; wait; exit $$status

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh $(wildcard scripts/install/*.sh scripts/install/*.py) services/models/build.py
	bash scripts/setup.sh
	touch $@

# The lint and type gates alone (make test runs them too, in tests/unit/test_code_gates.py).
lint: setup
	$(BIN)/python -m ruff check services tests scripts
	$(BIN)/python scripts/typecheck.py

# Regenerate the protobuf stubs and Envoy's descriptor set from protos/.
protos: setup
	$(BIN)/python -m services.tools.protogen

# Re-render the checked-in Envoy configs from their topologies.
render: setup
	$(BIN)/kvmesh envoy render --all

# Re-render the Grafana boards and alert rules (deploy/overlays/monitoring/) from services/observability/.
dashboards: setup
	$(BIN)/python -m services.cli dashboards render

# The container images (Dockerfile; needs docker or another BuildKit client,
# which this machine has not: tests/unit/test_dockerfile.py reads the file instead).
images:
	docker build --target cpu -t kvmesh:cpu .
	docker build --target gpu -t kvmesh:gpu .

clean:
	rm -rf $(VENV) .run .models
