# `make demo` and `make test` set everything up on a fresh machine, then run.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup demo test bench plots docs

setup: $(STAMP)

# torch is installed first so that pip takes the CPU build on disk, not a CUDA build; then the
# package within its declared ranges, at the versions constraints.txt pins (what CI tests).
$(STAMP): pyproject.toml constraints.txt
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints.txt torch
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	touch $(STAMP)

demo: setup
	cd examples && $(abspath $(PY)) demo.py

test: setup
	$(PY) -m pytest -q -n 2 --dist loadfile

bench: setup
	$(PY) bench/compiler_throughput.py
	$(PY) bench/device_iterations.py
	$(PY) bench/core_scaling.py
	$(PY) bench/pipeline_overhead.py
	$(PY) bench/lightning_trainer.py
	$(PY) bench/short_fit.py
	$(PY) bench/plots.py

# The performance guide's images (docs/img/): the throughput chart from bench/results/*.json and
# the replicated-scaling loss curves of examples/scaling.py.
plots: setup
	$(PY) bench/plots.py
	cd examples && $(abspath $(PY)) scaling.py --plot ../docs/img/scaling.png

# The documentation site (mkdocs.yml), built offline into build/site; --strict fails on any warning.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict
