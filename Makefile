# Two commands do all set-up on a fresh machine: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test install clean bench

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch==2.13.0 is installed first and on its own: it is the CPU build that lies on disk.
# An open `torch` requirement on a venv without torch would pull a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,monitor]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/epscale train --config configs/tiny.yaml

# Two pytest workers, one test file each at a time (a file's spawned ranks share its
# fixtures): much of the suite waits (process start-up, rendezvous, restarts, timeouts)
# rather than computes, and the other worker fills that time.
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=15 tests

# The MoE-layer benchmark in bf16 (the issue's headline dtype). The torchtitan and HF
# Mixtral comparisons run when those packages import; see benchmarks/RESULTS.md for the
# --no-deps install line that keeps torch==2.13.0.
bench: $(STAMP)
	$(PY) benchmarks/moe_layer.py --dtypes bfloat16

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
