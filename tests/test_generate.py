"""``hpctrain generate``: text from a GPT checkpoint of any layout, deterministic for a seed; other
models refused clearly."""

from __future__ import annotations

import os

import pytest

from hpctrain.cli import main
from hpctrain.job import run

GPT = {"model": "gpt", "max_samples": 64, "batch_size": 16, "epochs": 1, "d_model": 32, "n_heads": 4,
       "block_size": 16, "log_every": 1000}


@pytest.fixture
def solo(comm):
    c = comm.split(comm.rank)
    yield c
    c.free()


def _generate(capsys, *argv) -> tuple[int, str, str]:
    code = main(["generate", *argv])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_generate_is_deterministic_for_a_seed(solo, tmp_path, capsys):
    s = run({**GPT, "run_dir": str(tmp_path / "g")}, solo)
    capsys.readouterr()
    args = ["--prompt", "ROMEO:", "--tokens", "40", "--temperature", "0.8", "--top-k", "10"]
    code, a, err = _generate(capsys, str(tmp_path / "g"), *args, "--seed", "1")
    assert code == 0, err
    assert a.startswith("ROMEO:") and len(a.rstrip("\n")) >= len("ROMEO:") + 40 - 1
    assert _generate(capsys, str(tmp_path / "g"), *args, "--seed", "1")[1] == a  # same seed, same text
    assert _generate(capsys, s["checkpoint"], *args, "--seed", "1")[1] == a  # the file itself works too
    assert _generate(capsys, str(tmp_path / "g"), *args, "--seed", "2")[1] != a


def test_generate_from_a_run_directory_skips_a_newest_file_that_does_not_load(solo, tmp_path, capsys):
    """``generate RUN_DIR`` samples the newest checkpoint that loads (checksums verified), not the
    newest name: a damaged or foreign file there is skipped, said so; none loading is refused."""
    s = run({**GPT, "run_dir": str(tmp_path / "g")}, solo)
    capsys.readouterr()
    args = ["--prompt", "ROMEO:", "--tokens", "20", "--seed", "1"]
    want = _generate(capsys, s["checkpoint"], *args)[1]
    bad = tmp_path / "g" / "checkpoints" / "ckpt-99999999.h5"
    bad.write_bytes(b"not a checkpoint")
    code, out, err = _generate(capsys, str(tmp_path / "g"), *args)
    assert code == 0 and out == want, err
    assert f"skipping checkpoint {bad}" in err
    os.remove(s["checkpoint"])
    code, _, err = _generate(capsys, str(tmp_path / "g"), *args)
    assert code == 4 and f"no checkpoint in {bad.parent} loads" in err and bad.name in err, err  # refused


def test_generate_refuses_what_it_cannot_sample(solo, tmp_path, capsys):
    run({"max_samples": 64, "batch_size": 16, "epochs": 1, "d_model": 16, "log_every": 1000,
         "run_dir": str(tmp_path / "mlp")}, solo)
    capsys.readouterr()
    code, _, err = _generate(capsys, str(tmp_path / "mlp"), "--tokens", "5")
    assert code == 4 and "holds a 'mlp' model, not a GPT" in err  # the run is refused: 4, as every command's
    code, _, err = _generate(capsys, str(tmp_path / "nothing"))
    assert code == 4 and "neither a run directory nor a checkpoint file" in err
    run({**GPT, "run_dir": str(tmp_path / "g")}, solo)
    capsys.readouterr()
    code, _, err = _generate(capsys, str(tmp_path / "g"), "--prompt", "\u00e9t\u00e9")
    assert code == 2 and "outside the run's vocabulary" in err
    code, _, err = _generate(capsys, str(tmp_path / "g"), "--temperature", "0")
    assert code == 2 and "--temperature must be > 0" in err


def test_generate_on_a_token_file_says_how_to_give_it_a_vocabulary(solo, tmp_path, capsys):
    import h5py
    import numpy as np

    data = tmp_path / "ids.h5"
    with h5py.File(data, "w") as f:
        f["chars"] = np.frombuffer(b"abcabd" * 100, dtype=np.uint8).astype(np.int64) - ord("a")
    run({**GPT, "data": str(data), "tokens_key": "chars", "block_size": 8, "run_dir": str(tmp_path / "g")}, solo)
    capsys.readouterr()
    code, _, err = _generate(capsys, str(tmp_path / "g"), "--prompt", "a", "--tokens", "5")
    assert code == 4 and f"{data} has no 'vocab' attribute" in err and "f.attrs['vocab']" in err, err
    with h5py.File(data, "a") as f:
        f.attrs["vocab"] = "ab"  # fewer characters than the 4 token ids: still refused, saying so
    code, _, err = _generate(capsys, str(tmp_path / "g"), "--prompt", "a", "--tokens", "5")
    assert code == 4 and "a 'vocab' of 2 characters for 4 token ids" in err, err
    with h5py.File(data, "a") as f:
        f.attrs["vocab"] = "abcd"  # as the message says: no retraining
    code, out, err = _generate(capsys, str(tmp_path / "g"), "--prompt", "a", "--tokens", "5")
    assert code == 0 and out.startswith("a") and set(out.strip()) <= set("abcd"), err


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_generate_from_a_pipeline_checkpoint(comm, shared_dir, capsys):
    # Written by 2+ pipeline stages, sampled by one process: the same text as from the same
    # weights trained by one process (the checkpoint holds full tensors under serial names).
    pp = run({**GPT, "strategy": "pp", "run_dir": os.path.join(shared_dir, "pp")}, comm)
    alone = comm.split(comm.rank)
    try:
        one = run({**GPT, "run_dir": os.path.join(shared_dir, f"one-{comm.rank}")}, alone)
    finally:
        alone.free()
    capsys.readouterr()
    if comm.rank == 0:
        args = ["--prompt", "ROMEO:", "--tokens", "30", "--top-k", "1"]  # greedy: robust to float rounding
        code, a, err = _generate(capsys, pp["run_dir"], *args)
        assert code == 0, err
        assert _generate(capsys, one["run_dir"], *args)[1] == a
    comm.barrier()


def test_generate_samples_with_one_blas_thread_and_shows_progress(solo, tmp_path, capsys, monkeypatch):
    """One BLAS thread by default (a thread per core made 200 tokens 3-17x slower), --threads N
    otherwise; --progress draws a bar on stderr and says the time; the text does not change."""
    from threadpoolctl import threadpool_info

    from hpctrain.nn import GPT as Model

    run({**GPT, "run_dir": str(tmp_path / "g")}, solo)
    capsys.readouterr()
    seen: list[int] = []
    forward = Model.forward

    def counting(self, x):  # the BLAS pools' sizes while generate samples
        seen.append(max(p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"))
        return forward(self, x)

    monkeypatch.setattr(Model, "forward", counting)
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    args = [str(tmp_path / "g"), "--prompt", "ROMEO:", "--tokens", "20", "--seed", "1"]
    code, plain, err = _generate(capsys, *args, "--no-progress")
    assert code == 0 and set(seen) == {1} and err == "", (seen, err)
    seen.clear()
    code, shown, err = _generate(capsys, *args, "--progress", "--threads", "2")
    assert code == 0 and shown == plain
    assert set(seen) == {2} or (set(seen) == {1} and os.cpu_count() == 1), seen  # a pool has no more than the cores
    assert "20/20" in err and "hpctrain generate: 20 characters in" in err and "(2 BLAS thread(s))" in err, err
    assert _generate(capsys, *args, "--threads", "0")[0] == 2
