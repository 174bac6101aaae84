"""The MPI underneath this job, in words (``hpctrain info``)."""

from __future__ import annotations

import mpi4py
from mpi4py import MPI


def versions() -> dict[str, str]:
    """``{"mpi4py": its version, "library": the MPI library's first version line, "standard": the
    MPI standard it implements}``."""
    return {"mpi4py": mpi4py.__version__, "library": MPI.Get_library_version().splitlines()[0].strip(),
            "standard": ".".join(map(str, MPI.Get_version()))}
