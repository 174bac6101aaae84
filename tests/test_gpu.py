"""GPU paths. The MPI side of the NCCL bootstrap runs everywhere; the rest needs CuPy and a
GPU and skips cleanly without them (CI has none)."""

from __future__ import annotations

import numpy as np
import pytest

from hpctrain import Communicator, backend
from hpctrain.comm import nccl
from hpctrain.errors import DtypeError

pytestmark = pytest.mark.timeout(120)
needs_gpu = pytest.mark.skipif(backend.cupy() is None, reason="needs CuPy and an NVIDIA GPU")


def test_nccl_id_bootstrap_over_mpi(comm):
    """Every rank receives rank 0's id, byte for byte (the id itself is opaque to us)."""
    rng = np.random.default_rng(comm.bcast_obj(int(np.random.default_rng().integers(1 << 30))))
    expected = tuple(int(v) for v in rng.integers(-128, 128, nccl.UNIQUE_ID_BYTES))
    calls = []

    def make_id():
        calls.append(1)
        return expected

    assert nccl.bootstrap_id(comm, make_id) == expected
    assert len(calls) == (1 if comm.rank == 0 else 0)


@pytest.mark.parametrize("form", ["bytes", "signed", "unsigned"])
def test_nccl_id_bootstrap_takes_bytes_or_a_sequence(comm, form):
    """CuPy >= 13 makes the id as ``bytes``, older CuPy as a tuple of (signed or unsigned) chars:
    every rank gets the same 128 signed bytes from each (the issue: ``bytes`` broke the bootstrap)."""
    raw = bytes(np.random.default_rng(comm.bcast_obj(int(np.random.default_rng().integers(1 << 30))))
                .integers(0, 256, nccl.UNIQUE_ID_BYTES, dtype=np.uint8))  # fmt: skip
    made = {"bytes": raw, "signed": tuple(int(b) for b in np.frombuffer(raw, np.int8)),
            "unsigned": tuple(raw)}[form]  # fmt: skip
    got = nccl.bootstrap_id(comm, lambda: made)
    assert got == tuple(int(b) for b in np.frombuffer(raw, np.int8))


def test_nccl_id_of_the_wrong_size_fails_on_every_rank(comm):
    with pytest.raises(ValueError, match="128 bytes"):
        nccl.bootstrap_id(comm, lambda: b"\x01" * 16)


def test_nccl_joins_with_the_id_form_its_cupy_takes():
    """Old CuPy's NcclCommunicator takes a tuple, newer ones bytes: ``join`` gives each its own."""
    uid = tuple(int(b) for b in np.arange(-64, 64, dtype=np.int8))

    class Takes:
        def __init__(self, kind):
            self.kind = kind

        def NcclCommunicator(self, size, commId, rank):  # noqa: N802 - CuPy's name
            if not isinstance(commId, self.kind):
                raise TypeError(f"commId must be {self.kind.__name__}")
            return commId

    assert nccl.join(Takes(tuple), 2, uid, 0) == uid
    assert nccl.join(Takes(bytes), 2, uid, 0) == np.array(uid, dtype=np.int8).tobytes()


def test_nccl_type_tables():
    assert nccl.nccl_dtype(np.float32) == 7 and nccl.nccl_dtype("float16") == 6
    assert nccl.nccl_dtype("bfloat16") == 9  # ncclBfloat16 (what CuPy names its bfloat16 dtype)
    with pytest.raises(DtypeError):
        nccl.nccl_dtype(np.complex64)
    with pytest.raises(ValueError, match="op must be"):
        nccl.nccl_op("prod-ish")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "float64", "int32", "float16"])
@pytest.mark.parametrize("op", ["sum", "mean", "max"])
def test_device_allreduce_matches_numpy(comm, dtype, op):
    cp = backend.cupy()
    if op == "mean" and dtype == "int32":
        pytest.skip("mean is defined for floating dtypes only")
    backend.select_device(comm.local_rank)
    all_x = np.stack([np.arange(1000, dtype=dtype) * (r + 1) for r in range(comm.size)])
    ref = {"sum": all_x.sum(0), "mean": all_x.mean(0), "max": all_x.max(0)}[op]
    for staged in (False, True):
        c = Communicator(comm.mpi)
        c._cuda_aware = False if staged else c.cuda_aware
        got = c.allreduce(cp.asarray(all_x[comm.rank]), op=op)
        assert isinstance(got, cp.ndarray)
        np.testing.assert_allclose(got.get(), ref.astype(dtype), rtol=1e-2 if dtype == "float16" else 1e-6)


@pytest.mark.gpu
@needs_gpu
def test_device_point_to_point_and_bcast(comm):
    cp = backend.cupy()
    backend.select_device(comm.local_rank)
    x = cp.full(257, comm.rank, dtype=cp.float32)
    comm.bcast(x, root=comm.size - 1)
    assert float(x[0].get()) == comm.size - 1
    if comm.size > 1:
        right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
        out = cp.empty(257, cp.float32)
        r = comm.irecv(out, source=left)
        comm.isend(cp.full(257, comm.rank, cp.float32), dest=right).wait()
        assert float(r.wait()[0].get()) == left


@pytest.mark.gpu
@needs_gpu
def test_nccl_allreduce_one_gpu_per_rank(comm):
    cp = backend.cupy()
    if cp.cuda.runtime.getDeviceCount() < comm.size:
        pytest.skip(f"NCCL needs one GPU per rank: {comm.size} ranks, "
                    f"{cp.cuda.runtime.getDeviceCount()} GPU(s)")
    backend.select_device(comm.local_rank)
    nc = nccl.NcclCommunicator(comm)
    x = cp.full(1 << 16, comm.rank + 1, dtype=cp.float32)
    np.testing.assert_allclose(nc.allreduce(x).get(), comm.size * (comm.size + 1) / 2)


def _dp_trainer(comm, xp_device: str, **kw):
    import hpctrain as ht
    from hpctrain.parallel import DataParallelTrainer

    model = ht.nn.Sequential(ht.nn.Linear(6, 8, rng=0), ht.nn.ReLU(), ht.nn.Linear(8, 3, rng=1)).to(xp_device)
    opt = ht.optim.SGD(model.parameters(), lr=0.1)
    return model, DataParallelTrainer(model=model, loss=ht.nn.MSELoss(), optimizer=opt, comm=comm, **kw)


def test_nccl_backend_refused_on_every_rank_without_a_gpu_model(comm):
    """A host model (or a rank without CuPy) cannot use NCCL: every rank says so, none hangs."""
    with pytest.raises(RuntimeError, match="backend='nccl' needs CuPy and the model on the GPU on every rank"):
        _dp_trainer(comm, "cpu", backend="nccl")
    with pytest.raises(ValueError, match="backend must be one of"):
        _dp_trainer(comm, "cpu", backend="gloo")


@pytest.mark.mpi(min_size=2)
def test_nccl_refused_on_every_rank_when_ranks_share_a_gpu(comm, standin):
    """NCCL cannot put two ranks on one GPU (the first GPU run: an NcclError from deep inside its
    init at -n 2 on one GPU): every rank is told which ranks share which GPU, before NCCL starts."""
    with pytest.raises(RuntimeError, match="needs one GPU per rank: ranks 0 and 1 share GPU 0"):
        _dp_trainer(comm, "gpu", backend="nccl")


@pytest.mark.gpu
@needs_gpu
def test_dp_nccl_backend_equals_mpi_backend(comm):
    cp = backend.cupy()
    if cp.cuda.runtime.getDeviceCount() < comm.size:
        pytest.skip(f"NCCL needs one GPU per rank: {comm.size} ranks, {cp.cuda.runtime.getDeviceCount()} GPU(s)")
    backend.select_device(comm.local_rank)
    g = np.random.default_rng(comm.rank)
    x, y = g.standard_normal((4, 6), dtype=np.float32), g.standard_normal((4, 3), dtype=np.float32)
    results = []
    for name in ("mpi", "nccl"):
        model, tr = _dp_trainer(comm, "gpu", backend=name)
        for _ in range(3):
            tr.step(cp.asarray(x), cp.asarray(y))
        results.append([p.data.get() for p in model.parameters()])
    for a, b in zip(*results):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
