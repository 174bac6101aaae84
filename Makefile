# Every target sets itself up on a fresh machine: a venv in .venv with hpctrain, the PyPI MPICH
# and the test tools. Re-running is quick: the stamp file skips pip when pyproject is unchanged.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
MPIEXEC := $(VENV)/bin/mpiexec
STAMP  := $(VENV)/.installed
# Each test gets a timeout (pyproject sets 180 s; the suite runs far under it). MPI runs
# go through `python -m mpi4py` so an exception on one rank aborts the whole job.
PYTEST_MPI := -m mpi4py -m pytest --with-mpi -q -p no:cacheprovider
MPIFLAGS ?=

.PHONY: venv test test-serial test-mpi2 test-mpi4 test-slurm demo bench lint clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[mpich,test]'
	touch $(STAMP)

test: test-serial test-mpi2 test-mpi4

test-serial: venv
	$(PY) -m pytest -q -p no:cacheprovider

test-mpi2: venv
	$(MPIEXEC) $(MPIFLAGS) -n 2 $(PY) $(PYTEST_MPI)

test-mpi4: venv
	$(MPIEXEC) $(MPIFLAGS) -n 4 $(PY) $(PYTEST_MPI)

demo: venv
	$(MPIEXEC) -n 2 $(VENV)/bin/hpctrain info

bench: venv
	$(MPIEXEC) -n 2 $(PY) benchmarks/allreduce.py
	$(MPIEXEC) -n 2 $(PY) benchmarks/ddp.py --quick --markdown benchmarks/REPORT.md
	$(MPIEXEC) -n 2 $(PY) benchmarks/tensor.py --quick --markdown benchmarks/REPORT.md
	$(MPIEXEC) -n 4 $(PY) benchmarks/pipeline.py --markdown benchmarks/REPORT.md
	$(MPIEXEC) -n 4 $(PY) benchmarks/param_server.py --quick --markdown benchmarks/REPORT.md

lint: venv
	$(VENV)/bin/ruff check hpctrain tests benchmarks

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
