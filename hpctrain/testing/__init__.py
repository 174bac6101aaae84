"""Testing MPI code with pytest: the plugin pytest loads when hpctrain is installed.

Run your tests as pytest-mpi documents them, on several ranks::

    mpiexec -n 2 python -m pytest --with-mpi             # pytest-mpi's form
    mpiexec -n 2 python -m mpi4py -m pytest --with-mpi   # the same; an error outside a test aborts

Under a launch of more than one rank the plugin (:mod:`hpctrain.testing.plugin`, the ``pytest11``
entry point ``hpctrain``) makes the ranks agree on each test's outcome when it ends:

- a test that fails on any rank fails on every rank, and rank 0's report shows each failing rank's
  traceback and captured output;
- a rank that does not finish a test (it waits in a collective a failed peer left, or hangs)
  ends the job, naming the test and the ranks that did not answer, with the failing rank's report
  on stderr: within ``--mpi-failure-grace`` seconds (default 10) of a failure, else
  ``--mpi-timeout`` (default 300; ``0``: no limit);
- rank 0 reports; the other ranks print only what rank 0 cannot show (their own collection
  errors, an internal error).

One rank (plain ``pytest``) changes nothing. ``-p no:hpctrain`` turns the plugin off.
"""
