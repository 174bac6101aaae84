"""`hpctrain plot RUN`: PNGs from a metrics file, and a clear message without matplotlib."""

from __future__ import annotations

import json
import sys

import pytest

from hpctrain.cli import main
from hpctrain.cli.plot import read_metrics


def _write_run(tmp_path, steps=30):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for s in range(1, steps + 1):
            f.write(json.dumps({"step": s, "epoch": 0, "loss": 2.0 / s, "seconds": 0.01, "samples": 64,
                                "comm_seconds": 0.002, "samples_per_s": 6400.0}) + "\n")
        f.write(json.dumps({"note": "not a step"}) + "\n")
    return tmp_path


def test_plot_writes_pngs(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is in the test extra; install '.[test]'")
    run = _write_run(tmp_path)
    assert main(["plot", str(run)]) == 0
    for name in ("loss.png", "throughput.png"):
        data = (run / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    assert "loss.png" in capsys.readouterr().out


def test_read_metrics_skips_non_step_lines_and_names_bad_ones(tmp_path):
    run = _write_run(tmp_path, steps=5)
    assert [r["step"] for r in read_metrics(str(run / "metrics.jsonl"))] == [1, 2, 3, 4, 5]
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{broken\n')
    with pytest.raises(ValueError, match="metrics.jsonl:2: not a JSON line"):
        read_metrics(str(run / "metrics.jsonl"))


def test_plot_errors_are_clear(tmp_path, capsys, monkeypatch):
    assert main(["plot", str(tmp_path / "nothing")]) == 2
    assert "no metrics file" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    assert main(["plot", str(_write_run(tmp_path))]) == 1
    assert "hpctrain plot needs matplotlib: pip install" in capsys.readouterr().err


def test_plot_draws_validation_loss_and_a_pipeline_timeline(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="matplotlib is in the test extra; install '.[test]'")
    from hpctrain.parallel.timeline import write_json

    run = _write_run(tmp_path)
    lines = (run / "metrics.jsonl").read_text()
    extra = [{"step": s, "epoch": 0, "loss": 2.0 / s, "val_loss": 3.0 / s, "seconds": 0.01, "samples": 64,
              "comm_seconds": 0.002} for s in (10, 20, 30)]
    # The same records with and without --eval-every's val_loss: only the validation curve differs.
    (run / "metrics.jsonl").write_text(lines + "".join(json.dumps({k: v for k, v in r.items() if k != "val_loss"})
                                                       + "\n" for r in extra))
    assert main(["plot", str(run)]) == 0
    plain = (run / "loss.png").read_bytes()
    (run / "metrics.jsonl").write_text(lines + "".join(json.dumps(r) + "\n" for r in extra))
    write_json(str(run / "timeline.json"), {0: [("F0", "forward", 0.0, 0.001), ("B0", "backward", 0.002, 0.004)],
                                            1: [("F0", "forward", 0.001, 0.002), ("B0", "backward", 0.002, 0.003)]})
    capsys.readouterr()
    assert main(["plot", str(run)]) == 0
    assert (run / "loss.png").read_bytes() != plain  # the validation curve is drawn
    assert "timeline.png" in capsys.readouterr().out
    data = (run / "timeline.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    (run / "timeline.json").write_text("[]")
    assert main(["plot", str(run)]) == 2
    assert "not a schedule timeline" in capsys.readouterr().err
