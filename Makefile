# The two commands: `make up` (set up, then run the mesh) and `make test`
# (set up, then run every test). Setup is idempotent and skipped when done.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.kvmesh-setup-done

.PHONY: up test setup lint protos render dashboards images clean

up: setup
	$(BIN)/kvmesh up $(ARGS)

test: setup
	$(BIN)/python -m pytest $(PYTEST_ARGS)

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
