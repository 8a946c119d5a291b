# The two commands: `make demo` and `make test`. Both create or refresh .venv.
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.regent-installed
export PYTHONUNBUFFERED := 1

.PHONY: demo test test-long lint venv bench clean proto

venv: $(STAMP)

$(STAMP): pyproject.toml scripts/bootstrap_venv.sh
	@VENV=$(VENV) sh scripts/bootstrap_venv.sh
	@touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/regent train --run-dir runs/demo

# The real-SLURM tests need a running cluster: start the single-node one when this machine can (root, SLURM
# packages installed; REGENT_INSTALL_SLURM=1 also installs them), else say loudly why they will skip.
test: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks
	@sh scripts/ensure_slurm.sh
	$(PY) -m pytest -q --durations=15 -m "not long" tests

# Everything, including the `long` end-to-end cases (regent train on the Kubernetes API stub and across
# network-namespace hosts, the stage-A controller-loss runs, and others whose parts faster tests cover; ~1-2 min
# each) that keep make test past its ~20 minute budget on a 2-core box.
test-long: $(STAMP)
	@sh scripts/ensure_slurm.sh
	$(PY) -m pytest -q --durations=15 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests benchmarks

clean:
	rm -rf $(VENV) runs build *.egg-info src/*.egg-info

# Regenerate the committed gRPC stubs after editing the .proto (needs the dev extra).
proto:
	cd src/regent/ft/proto && ../../../../$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. torchft.proto
	sed -i 's/^import torchft_pb2 as torchft__pb2/from regent.ft.proto import torchft_pb2 as torchft__pb2/' src/regent/ft/proto/torchft_pb2_grpc.py
	# the stubs demand the grpcio that generated them; they need nothing newer than pyproject's floor
	sed -i "s/^GRPC_GENERATED_VERSION = .*/GRPC_GENERATED_VERSION = '1.75.0'  # pyproject's grpcio floor (the Makefile's proto target sets it): the stubs use nothing newer/" src/regent/ft/proto/torchft_pb2_grpc.py
