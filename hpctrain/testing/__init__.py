"""Testing MPI code with pytest: the plugin pytest loads when hpctrain is installed.

Run your tests as pytest-mpi documents them, on several ranks::

    mpiexec -n 2 python -m pytest --with-mpi             # pytest-mpi's form
    mpiexec -n 2 python -m mpi4py -m pytest --with-mpi   # the same; an error outside a test aborts

Under a launch of more than one rank the plugin (:mod:`hpctrain.testing.plugin`, the ``pytest11``
entry point ``hpctrain``) makes the ranks agree on each test's outcome when it ends:

- a test that fails on any rank fails on every rank, and rank 0's report shows each failing rank's
  traceback and captured output;
- each test has a limit, ``--mpi-timeout`` seconds from its start on every rank (default 60;
  ini ``mpi_timeout``; ``@pytest.mark.mpi_timeout(seconds)`` for one test; ``0``: no limit). A
  rank still in the test then is asked where it is: rank 0's report of the test shows its Python
  stack (file and line), pytest stops and prints its summary, and the job ends (``MPI_Abort``,
  exit 3). A rank that failed the test waits only ``--mpi-failure-grace`` seconds (default 10);
- ``pytest.exit`` or ``KeyboardInterrupt`` on one rank stops every rank's session alike;
  ``os._exit`` in a test on one rank ends the job non-zero after rank 0's summary names the rank;
  a skip on some ranks only is a skip on every rank;
- rank 0 reports; the other ranks print only what rank 0 cannot show (their own collection
  errors, an internal error). Several ranks without ``--with-mpi`` get a warning that pytest-mpi
  skips the tests marked ``mpi``.

One rank (plain ``pytest``) changes nothing. ``-p no:hpctrain`` turns the plugin off.
"""
