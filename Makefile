# fedray: every target installs first if needed (.venv, editable, with dev extras).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
CONFIG ?= configs/quickstart.yaml
ALGO ?=
ARGS ?=
PORT ?= 5000
EXP ?=
OUT ?=
PAPER ?=
# the suite runs in this many pytest processes, a test file each at a time: on two cores, a third
# keeps them busy while the others' tests wait on servers, subprocesses and a 30 s tracking outage;
# the slowest files first, in the order tests/conftest.py gives (SLOW_FILES_FIRST)
TEST_PROCESSES ?= 3

.PHONY: install run compare sweep report test test-slow lint typecheck bench bench-scale gpu-check reproduce ui clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip "setuptools>=77" wheel
	$(BIN)/pip install --quiet -e ".[dev]"
	touch $@

install: $(VENV)/.installed

run: install  ## the quickstart (or CONFIG=...), e.g. make run ALGO=fedprox ARGS="rounds=50"
	$(BIN)/fedray run $(CONFIG) $(if $(ALGO),algorithm=$(ALGO)) $(ARGS)

compare: install  ## every algorithm on the same digits partition, one table (COMPARE=... for another file)
	$(BIN)/fedray compare $(or $(COMPARE),configs/compare_digits.yaml) $(ARGS)

sweep: install  ## Ray Tune sweep, e.g. make sweep ALGO=fedcross [CONFIG=...] [ARGS="--samples 8 rounds=30"]
	$(BIN)/fedray sweep --algo $(or $(ALGO),fedcross) --config $(CONFIG) $(ARGS)

report: install  ## HTML report of an MLflow experiment: make report EXP=quickstart [OUT=dir] [ARGS="--target 0.9"]
	@test -n "$(EXP)" || { echo 'usage: make report EXP=<experiment> [OUT=dir] [ARGS="--target 0.9"]' >&2; exit 2; }
	$(BIN)/fedray report "$(EXP)" $(if $(OUT),--out "$(OUT)") $(ARGS)

lint: install
	$(BIN)/ruff check .

typecheck: install  ## mypy on the fedray package
	@mkdir -p $(VENV)/typecheck/fedray
	@for d in platform algorithms sweeps dashboards; do ln -sfn ../../../$$d $(VENV)/typecheck/fedray/$$d; done
	MYPYPATH=$(VENV)/typecheck $(BIN)/mypy -p fedray

test: install lint typecheck  ## lint, type check, then the default suite (slow real-data tests excluded)
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile --no-loadscope-reorder --durations=20

test-slow: install  ## the real-data checks (the CIFAR-10 JPEG archive: FEDRAY_CIFAR10_ARCHIVE=... or .data/)
	$(BIN)/python -m pytest -q -m slow -s --timeout 0  # no backstop: one check runs FedCross 150 rounds

bench: install  ## fedray vs a plain PyTorch loop on real CIFAR-10
	$(BIN)/python benchmarks/bench_fedavg_cifar.py $(ARGS)

bench-scale: install  ## FedSSA on CIFAR-10 at 100/1,000/10,000 clients, e.g. make bench-scale ARGS="--clients 100 --rounds 2"
	$(BIN)/python benchmarks/bench_scale.py $(ARGS)

gpu-check: install  ## on a GPU node: nine checks, one table, ~8 min on an H200 (no GPU: one line, exit 0), e.g. ARGS="--only 1,4"
	@$(BIN)/python benchmarks/gpu_check.py $(ARGS)

reproduce: install  ## a paper's comparison (CIFAR-10 JPEGs, or LEAF's files by --data): make reproduce PAPER=fedssa [ARGS="--scale full"]
	@test -n "$(PAPER)" || { echo 'usage: make reproduce PAPER=fedcross|fedssa|fedl2g|fedsc|fedcross_femnist|fedcross_shakespeare [ARGS="--seeds 0,1,2 --scale full"]' >&2; exit 2; }
	$(BIN)/python benchmarks/reproduce_papers.py $(PAPER) $(ARGS)

ui: install  ## the MLflow UI on the project's store; prints the runs table's address (EXP=name for another)
	$(BIN)/fedray ui --port $(PORT) $(if $(EXP),--experiment "$(EXP)")

clean:
	rm -rf .fedray mlartifacts mlflow.db reports .pytest_cache .ruff_cache
