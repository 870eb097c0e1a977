# The two set-up commands of the README: each creates .venv on a fresh clone and installs everything.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast test-flower test-kernels lint bench install clean

$(STAMP): pyproject.toml constraints.txt
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# the CPU wheel first, pinned: an unpinned torch would pull GBs of CUDA packages
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -c constraints.txt -e '.[dev,clip,flower,tracking,privacy,tune]'
	# CacheFL's open_clip backbone: no torchvision (see pyproject's clip extra), torch left as pinned
	$(BIN)/pip install -q -c constraints.txt --no-deps 'open-clip-torch==3.3.0'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/fedskew demo

test: $(STAMP)
	$(BIN)/ruff check src tests benchmarks
	# the type checker over src/ (settings: pyproject's [tool.mypy])
	$(BIN)/python -m mypy src/fedskew
	# the 25 slowest tests are printed: the suite is kept under ~8 minutes on 2 cores
	$(BIN)/python -m pytest -n 2 -m "not flower_runtime" --durations=25 tests

# only the tests whose numbers depend on PyTorch's CPU kernels (tests/conftest.py KERNELS): CI runs them a
# second time on ATen's AVX2 kernels (ATEN_CPU_CAPABILITY=avx2 make test-kernels)
test-kernels: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m "kernels and not flower_runtime" --durations=25 tests

# Flower's Ray simulation of the listed methods and the CLI's loopback deployment (~3 minutes of start-ups);
# the TLS + authentication deployment tests (node kill, ServerApp resume) run in `make test`
test-flower: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m flower_runtime tests

# the edit loop: everything but the tests marked slow (subprocesses, end-to-end learning, mode parity)
test-fast: $(STAMP)
	$(BIN)/python -m pytest -n 2 -m "not slow" tests

lint: $(STAMP)
	$(BIN)/ruff check src tests benchmarks

bench: $(STAMP)
	# the peers engine_speed.py compares against, side by side in one run: Flower (Ray) and pfl
	$(BIN)/pip install -q -c constraints.txt -e '.[bench]'
	$(BIN)/python benchmarks/run_all.py $(if $(QUICK),--quick,)

clean:
	rm -rf $(VENV) build *.egg-info
