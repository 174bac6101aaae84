"""Training controls of ``hpctrain train``: each flag changes what the job does (observed in the
metrics, the checkpoints or the trainer), and each is also a TOML key."""

from __future__ import annotations

import json
import math
import os
import time

import numpy as np
import pytest

import hpctrain as ht
from hpctrain import errors
from hpctrain.job import Config, build_model, merge, open_data, read_config, resolve, run

# One process (each rank its own copy on a split communicator, in its own tmp_path): 4 steps an epoch.
BASE = {"max_samples": 128, "batch_size": 32, "epochs": 2, "d_model": 16, "log_every": 1000}


@pytest.fixture
def solo(comm):
    c = comm.split(comm.rank)
    yield c
    c.free()


def job(solo, where, name, **kw):
    return run({**BASE, **kw, "run_dir": os.path.join(str(where), name)}, solo)


def metrics(s) -> list[dict]:
    return [json.loads(x) for x in open(s["metrics"])]


def test_every_control_is_a_toml_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('max-steps = 5\nlr-schedule = "cosine"\nwarmup = 2\nmin-lr = 1e-4\nclip-norm = 1.0\n'
                    'accum-steps = 2\neval-every = 3\nkeep = 1\ncompression = "bf16"\ntimeout = 30.0\n'
                    'on-nonfinite = "skip"\ndropout = 0.1\n')
    c = merge(read_config(str(path)), {})
    assert isinstance(c, Config)
    assert (c.max_steps, c.lr_schedule, c.warmup, c.min_lr, c.clip_norm, c.accum_steps, c.eval_every, c.keep,
            c.compression, c.timeout, c.on_nonfinite, c.dropout) == (
        5, "cosine", 2, 1e-4, 1.0, 2, 3, 1, "bf16", 30.0, "skip", 0.1)


@pytest.mark.parametrize("kw, message", [
    ({"max_steps": 0}, "--max-steps must be >= 1"),
    ({"accum_steps": 3}, "does not split into --accum-steps 3"),
    ({"clip_norm": 0.0}, "--clip-norm must be > 0"),
    ({"dropout": 1.0}, "--dropout must be in [0, 1)"),
    ({"timeout": -1.0}, "timeout must be a finite number"),
    ({"compression": "bf16"}, "dp=1"),
    ({"strategy": "ps", "clip_norm": 1.0}, "--clip-norm is not possible"),
    ({"lr_schedule": "cosine", "lr": 0.01, "min_lr": 0.1}, "--min-lr 0.1 must not exceed --lr 0.01"),
])
def test_bad_controls_refused(kw, message):
    with pytest.raises(errors.ConfigError, match=message.replace("[", r"\[").replace(")", r"\)")):
        resolve({**BASE, **kw}, world=1)


def test_max_steps_stops_mid_epoch_and_a_longer_run_goes_on(solo, tmp_path):
    s = job(solo, tmp_path, "cap", max_steps=3)
    assert s["steps"] == 3 and [r["step"] for r in metrics(s)] == [1, 2, 3]
    # Resumed with a larger cap: continues exactly like a run capped there from the start.
    more = job(solo, tmp_path, "cap", max_steps=6, resume=True)
    straight = job(solo, tmp_path, "straight", max_steps=6)
    assert more["steps"] == 6 and more["steps_this_run"] == 3
    assert more["val_loss"] == straight["val_loss"]


def test_trace_json_keeps_every_job_of_a_resumed_run(solo, tmp_path):
    """trace.json gains each job's steps (a preempted job's too) instead of the last job's only,
    and stays one valid Chrome trace with one name per rank's lane."""
    from hpctrain import preempt

    class StopAfter2:
        def on_step_end(self, trainer, stats):
            if trainer.global_step == 2:
                preempt.request("test")  # carried by the next step: the job stops after step 3

    try:
        with pytest.raises(errors.Preempted):
            run({**BASE, "run_dir": os.path.join(str(tmp_path), "tr")}, solo, callbacks=[StopAfter2()])
    finally:
        preempt.clear()
    job(solo, tmp_path, "tr", max_steps=6, resume=True)
    s = job(solo, tmp_path, "tr", resume=True)
    with open(s["trace"]) as f:
        events = json.load(f)["traceEvents"]
    assert [e["name"] for e in events if e["ph"] == "X" and e["tid"] == 0] == [f"step {k}" for k in range(1, 9)]
    assert [e["pid"] for e in events if e["name"] == "process_name"] == [0]


def test_a_trace_json_that_is_not_a_trace_is_moved_aside_not_overwritten(solo, tmp_path):
    from hpctrain.job.trace import Timeline

    path = tmp_path / "trace.json"
    path.write_text('{"traceEv')
    t = Timeline(0)
    t.on_step_end(type("T", (), {"global_step": 1})(), type("S", (), {"seconds": 0.1, "comm_seconds": 0.0,
                                                                    "loss": 1.0})())
    t.write(solo, str(path))
    assert [e["name"] for e in json.loads(path.read_text())["traceEvents"]] == ["process_name", "step 1"]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("trace.json.replaced-")]
    assert len(aside) == 1 and aside[0].read_text() == '{"traceEv'


def test_lr_schedule_cosine_with_warmup_and_min_lr(solo, tmp_path):
    s = job(solo, tmp_path, "cos", lr=0.01, lr_schedule="cosine", warmup=2, min_lr=0.001)
    lrs = [r["lr"] for r in metrics(s)]
    total = 8
    want = [0.01 * (k + 1) / 2 if k < 2 else
            0.001 + 0.009 * 0.5 * (1 + math.cos(math.pi * (k - 2) / (total - 1 - 2))) for k in range(total)]
    np.testing.assert_allclose(lrs, want, rtol=1e-12)
    assert lrs[-1] == pytest.approx(0.001)  # ends at --min-lr
    flat = job(solo, tmp_path, "const", lr=0.01)
    assert [r["lr"] for r in metrics(flat)] == [0.01] * total
    assert flat["val_loss"] != s["val_loss"]  # the schedule changed the training


def _weights(s, cfg):
    c = resolve({**BASE, **cfg}, world=1)
    _, _, meta = open_data(c)
    model = build_model(c, meta)
    start = {n: p.data.copy() for n, p in model.named_parameters()}
    ht.checkpoint.load_weights(s["checkpoint"], model)
    return start, {n: p.data.copy() for n, p in model.named_parameters()}


def test_clip_norm_bounds_the_update(solo, tmp_path):
    cfg = {"optimizer": "sgd", "momentum": 0.0, "lr": 0.5, "max_steps": 1}
    s = job(solo, tmp_path, "clip", clip_norm=1e-3, **cfg)
    start, end = _weights(s, cfg)
    step = math.sqrt(sum(float(((end[n] - start[n]) ** 2).sum()) for n in start))
    assert step == pytest.approx(0.5 * 1e-3, rel=1e-3)  # lr x the clipped norm
    assert metrics(s)[0]["grad_norm"] > 1e-2  # the gradient itself was larger
    free = job(solo, tmp_path, "noclip", **cfg)
    start, end = _weights(free, cfg)
    assert math.sqrt(sum(float(((end[n] - start[n]) ** 2).sum()) for n in start)) > 10 * step


def test_accum_steps_runs_micro_batches(solo, tmp_path):
    class Peak:
        def __init__(self):
            self.peak = 0

        def on_step_end(self, trainer, stats):
            self.peak = max(self.peak, stats.memory.get("activations_peak", 0))

    one, four = Peak(), Peak()
    a = run({**BASE, "max_steps": 2, "run_dir": os.path.join(tmp_path, "a1")}, solo, callbacks=[one])
    b = run({**BASE, "max_steps": 2, "accum_steps": 4, "run_dir": os.path.join(tmp_path, "a4")}, solo,
            callbacks=[four])
    assert 0 < four.peak < 0.5 * one.peak  # a quarter of the batch in flight at a time
    assert b["val_loss"] == pytest.approx(a["val_loss"], rel=1e-5)  # the same update


def test_eval_every_logs_validation_loss_during_training(solo, tmp_path, capsys):
    s = job(solo, tmp_path, "eval", eval_every=3, log_every=3)
    rows = metrics(s)
    assert [r["step"] for r in rows if "val_loss" in r] == [3, 6]
    assert "| val " in capsys.readouterr().out
    # At the last step the value is the final evaluation's (the same weights, the same data).
    t = job(solo, tmp_path, "eval4", eval_every=4)
    assert metrics(t)[-1]["val_loss"] == pytest.approx(t["val_loss"], rel=1e-6)


def test_progress_lines_count_epochs_from_1_and_say_a_validation_loss_once_with_its_step(solo, tmp_path, capsys):
    s = job(solo, tmp_path, "lines", eval_every=3, log_every=2)
    val = {r["step"]: r["val_loss"] for r in metrics(s) if "val_loss" in r}
    per_epoch = s["steps"] // BASE["epochs"]
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("epoch ")]
    assert len(lines) == s["steps"] // 2, lines
    for line in lines:
        step = int(line.split()[3].split("/")[0])
        assert line.startswith(f"epoch {(step - 1) // per_epoch + 1} step {step}/"), line  # as --epochs counts
        fresh = [v for v in val if step - 2 < v <= step]  # reported since the line before
        said = f"| val {val[fresh[0]]:.4f} (step {fresh[0]})" if fresh else None
        assert (said in line) if said else "| val" not in line, (line, val)


def test_keep_bounds_the_checkpoints(solo, tmp_path):
    s = job(solo, tmp_path, "keep", keep=2, checkpoint_every=1)
    names = sorted(os.path.basename(p) for p in ht.checkpoint.list_checkpoints(os.path.dirname(s["checkpoint"])))
    assert names == ["ckpt-00000007.h5", "ckpt-00000008.h5"]
    parts = sorted(n.split(".h5.")[0] for n in os.listdir(os.path.dirname(s["checkpoint"])) if n.endswith(".parts"))
    assert parts == ["ckpt-00000007", "ckpt-00000008"]  # the deleted checkpoints' part files went with them


def test_async_keep_1_always_leaves_a_committed_checkpoint_and_keeps_one(solo, tmp_path):
    """--async-checkpoint --keep 1: an older checkpoint goes only once a newer one is committed (a
    watcher sees at least one from the first commit on), and exactly one is left, not all."""
    import threading

    d = os.path.join(str(tmp_path), "ak", "checkpoints")
    seen: list[int] = []  # how many committed checkpoints the watcher saw, each time it looked
    done = threading.Event()

    def watch():
        while not done.is_set():
            seen.append(len(ht.checkpoint.list_checkpoints(d)))
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        s = job(solo, tmp_path, "ak", keep=1, checkpoint_every=1, async_checkpoint=True)
    finally:
        done.set()
        watcher.join()
    first = next(i for i, n in enumerate(seen) if n)
    assert 0 not in seen[first:], "a moment with no committed checkpoint on disk"
    assert [os.path.basename(p) for p in ht.checkpoint.list_checkpoints(d)] == ["ckpt-00000008.h5"]
    assert s["checkpoint"] == os.path.join(d, "ckpt-00000008.h5")
    assert [n.split(".h5.")[0] for n in os.listdir(d) if n.endswith(".parts")] == ["ckpt-00000008"]


def test_keep_counts_the_checkpoints_a_resumed_run_finds(solo, tmp_path):
    """A resumed (requeued) run keeps --keep checkpoints in all, not --keep per job."""
    s = job(solo, tmp_path, "rk", keep=2, checkpoint_every=1, max_steps=4)
    d = os.path.dirname(s["checkpoint"])
    assert [os.path.basename(p) for p in ht.checkpoint.list_checkpoints(d)] == ["ckpt-00000003.h5",
                                                                                 "ckpt-00000004.h5"]
    job(solo, tmp_path, "rk", keep=2, checkpoint_every=1, resume=True)
    assert [os.path.basename(p) for p in ht.checkpoint.list_checkpoints(d)] == ["ckpt-00000007.h5",
                                                                                 "ckpt-00000008.h5"]


def test_timeout_reaches_the_trainer(solo, tmp_path):
    class Seen:
        def on_fit_start(self, trainer):
            self.timeout = trainer.timeout

    seen = Seen()
    run({**BASE, "max_steps": 1, "timeout": 12.5, "run_dir": os.path.join(tmp_path, "t")}, solo, callbacks=[seen])
    assert seen.timeout == 12.5


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the NaN is the point
def test_on_nonfinite_skip_or_raise(solo, tmp_path):
    # A learning rate this large sends the weights to inf after one step: the next loss is not finite.
    cfg = {"optimizer": "sgd", "momentum": 0.0, "lr": 1e300, "max_steps": 3}
    with np.errstate(all="ignore"):
        with pytest.raises(errors.HpctrainError, match="(?i)non-finite|nan|inf"):
            job(solo, tmp_path, "raise", **cfg)
        s = job(solo, tmp_path, "skip", on_nonfinite="skip", **cfg)
    assert [r["skipped"] for r in metrics(s)][1:] == [True, True]


def test_dropout_changes_training_not_the_weights_it_starts_from(solo, tmp_path):
    plain = job(solo, tmp_path, "nodrop", max_steps=2)
    drop = job(solo, tmp_path, "drop", max_steps=2, dropout=0.5)
    again = job(solo, tmp_path, "drop2", max_steps=2, dropout=0.5)
    assert drop["final_loss"] != plain["final_loss"]
    assert drop["final_loss"] == again["final_loss"]  # seeded: reproducible
    s0, _ = _weights(plain, {"max_steps": 2})
    s1, _ = _weights(drop, {"max_steps": 2, "dropout": 0.5})
    # The Dropout layers shift the Sequential's indices (names); the weights, in order, are the same.
    assert len(s0) == len(s1) and all(np.array_equal(a, b) for a, b in zip(s0.values(), s1.values()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_compression_rounds_the_gradient_all_reduce(comm, shared_dir):
    cfg = {**BASE, "batch_size": 8 * comm.size, "max_samples": 32 * comm.size, "max_steps": 3}
    exact = run({**cfg, "run_dir": os.path.join(shared_dir, "fp64")}, comm)
    bf16 = run({**cfg, "compression": "bf16", "run_dir": os.path.join(shared_dir, "bf16")}, comm)
    # The gradients went through 16 bits: the training loss moves (the float32 validation loss
    # after 3 steps can round to the same value, so it is only checked to stay close).
    assert bf16["final_loss"] != exact["final_loss"]
    assert bf16["final_loss"] == pytest.approx(exact["final_loss"], rel=1e-2)
    assert bf16["val_loss"] == pytest.approx(exact["val_loss"], rel=1e-2)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("extra", [{"strategy": "tp", "d_model": 32}, {"strategy": "pp"},
                                   {"model": "gpt", "strategy": "pp", "block_size": 16, "d_model": 32}],
                         ids=["mlp-tp", "mlp-pp", "gpt-pp"])
def test_eval_every_under_any_layout(comm, shared_dir, extra):
    if extra["strategy"] == "tp" and 128 % comm.size:
        pytest.skip(f"the hidden width 128 does not split over tp={comm.size}")
    cfg = {**BASE, "batch_size": 16, "max_samples": 64, "max_steps": 4, "eval_every": 2, **extra}
    s = run({**cfg, "run_dir": os.path.join(shared_dir, "ev")}, comm)
    if comm.rank == 0:
        rows = metrics(s)
        assert [r["step"] for r in rows if "val_loss" in r] == [2, 4]
        # The full weights gathered from the shards evaluate like the final checkpoint does.
        assert rows[-1]["val_loss"] == pytest.approx(s["val_loss"], rel=1e-5)
    comm.barrier()


def test_async_checkpoint_flag_writes_in_the_background(solo, tmp_path, monkeypatch):
    """--async-checkpoint (TOML async_checkpoint): the periodic saves return after the snapshot
    and are written by a background thread; the last one is committed before the job ends."""
    from hpctrain import checkpoint

    toml = tmp_path / "run.toml"
    toml.write_text("async-checkpoint = true\n")
    assert merge(read_config(str(toml)), {}).async_checkpoint is True
    real = checkpoint.save
    calls: list[tuple[int, bool, bool]] = []  # (step, asynchronous, a writer thread started)

    def spy(path, trainer, *, asynchronous=False, after=None):
        out = real(path, trainer, asynchronous=asynchronous, after=after)
        job = trainer.checkpointer.job
        calls.append((trainer.global_step, asynchronous, job is not None and job.thread is not None))
        return out

    monkeypatch.setattr(checkpoint, "save", spy)
    s = job(solo, tmp_path, "async", checkpoint_every=2, async_checkpoint=True)
    assert calls == [(2, True, True), (4, True, True), (6, True, True), (8, True, True)]
    # ... and the last one (step 8) was committed before the job ended:
    ckpts = checkpoint.list_checkpoints(os.path.join(str(tmp_path), "async", "checkpoints"))
    assert [os.path.basename(p) for p in ckpts] == ["ckpt-00000004.h5", "ckpt-00000006.h5", "ckpt-00000008.h5"]
    calls.clear()
    b = job(solo, tmp_path, "blocking", checkpoint_every=2)
    assert calls and not any(a for _, a, _ in calls)
    assert [m["loss"] for m in metrics(s)] == [m["loss"] for m in metrics(b)]  # same training either way
