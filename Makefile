# The two commands: `make run` (the main job on the built-in tiny target) and `make test`.
# Both create or update .venv first (scripts/setup_env.sh), so they work on a fresh machine.
VENV ?= .venv
PYTEST_ARGS ?=

.PHONY: setup run test bench lint docs

setup:
	@EAGLE_RAY_VENV=$(VENV) ./scripts/setup_env.sh

run: setup
	$(VENV)/bin/eagle-ray train --config examples/tiny.yaml

test: setup
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

bench: setup
	$(VENV)/bin/eagle-ray bench encodings
	$(VENV)/bin/eagle-ray bench backends

lint: setup
	$(VENV)/bin/ruff check .

# The generated references (tests/test_docs.py fails when they are stale).
docs: setup
	$(VENV)/bin/python -m eagle_ray.config.reference > docs/configuration.md
	$(VENV)/bin/python -m eagle_ray.bench.tables > docs/benchmarks.md
