"""Files other processes may touch: run directories (one job at a time, exclusive writes:
:mod:`.rundir`) and HDF5 files from anyone, opened only for what they store (:mod:`.h5safe`)."""
