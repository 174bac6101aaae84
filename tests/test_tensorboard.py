"""``hpctrain train --logger tensorboard``: rank 0 writes TensorBoard event files beside
metrics.jsonl, and they hold what metrics.jsonl holds (read back here, record by record, with the
event protocol tensorboardX ships; issue 37)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

tensorboardX = pytest.importorskip("tensorboardX", reason="pip install tensorboardX (make venv installs it)")

TINY = ("--max-samples", "288", "--batch-size", "48", "--epochs", "2", "--d-model", "16", "--n-layers", "1",
        "--log-every", "1000")


def read_events(directory: Path) -> dict[str, dict[int, float]]:
    """``{tag: {step: value}}`` of every scalar in the event files of ``directory`` (TFRecords:
    length, its CRC, the Event protocol buffer, its CRC)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, dict[int, float]] = {}
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            (length,) = struct.unpack_from("<Q", data, at)
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + length])
            at += 12 + length + 4
            for value in event.summary.value:
                scalars.setdefault(value.tag, {})[event.step] = value.simple_value
    return scalars


def test_event_files_hold_the_runs_metrics(comm, tmp_path, capsys):
    from hpctrain.cli import main

    run = Path(comm.bcast_obj(str(tmp_path / "run") if comm.rank == 0 else None))
    assert main(["train", *TINY, "--eval-every", "4", "--logger", "tensorboard", "--run-dir", str(run)]) == 0
    # A resume appends its own file; the curves go on from the step it resumed at.
    assert main(["train", "--run-dir", str(run), "--resume", "--epochs", "3"]) == 0
    capsys.readouterr()
    comm.barrier()
    if comm.rank != 0:
        return
    events = read_events(run / "tensorboard")
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert sorted(events["train/loss"]) == [m["step"] for m in metrics] == list(range(1, 19))
    for m in metrics:
        assert events["train/loss"][m["step"]] == pytest.approx(m["loss"], rel=1e-6)
        assert events["train/lr"][m["step"]] == pytest.approx(m["lr"], rel=1e-6)
    assert sorted(events["val/loss"]) == [4, 8, 12, 16]
    assert {"train/grad_norm", "train/samples_per_s", "train/step_ms", "train/comm_share"} <= set(events)
    assert len(list((run / "tensorboard").glob("events.out.tfevents.*"))) == 2  # one per job


def test_without_tensorboardx_the_flag_is_refused_before_training(comm, tmp_path, capsys, monkeypatch):
    import sys

    from hpctrain.cli import main

    monkeypatch.setitem(sys.modules, "tensorboardX", None)  # as if not installed
    run = Path(comm.bcast_obj(str(tmp_path / "run") if comm.rank == 0 else None))
    assert main(["train", *TINY, "--logger", "tensorboard", "--run-dir", str(run)]) == 4
    err = comm.bcast_obj(capsys.readouterr().err)
    if comm.rank == 0:
        assert "--logger tensorboard: TensorBoard event files need tensorboardX" in err and "pip install" in err
    assert not run.exists()
