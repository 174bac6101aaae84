"""``hpctrain train --help`` grouped by the configuration's sections and ending with examples that
parse; ``--dry-run`` tries one of everything and writes nothing to the run directory (issue 37)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from hpctrain.job.config import ALL_SECTIONS, EXAMPLES, HELP_SECTIONS, OPTIONS, flag

TINY = ("--max-samples", "288", "--batch-size", "48", "--epochs", "2", "--d-model", "16", "--n-layers", "1",
        "--log-every", "1000")


def _help() -> str:
    from hpctrain.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if hasattr(a, "choices") and isinstance(a.choices, dict))
    return sub.choices["train"].format_help()


def test_help_groups_the_flags_by_section_and_ends_with_examples_that_parse():
    text = _help()
    titles = [HELP_SECTIONS[name] for name in HELP_SECTIONS]
    where = [text.index(f"\n{title}:\n") for title in titles]
    assert where == sorted(where)  # every section, in the documented order
    for section in ALL_SECTIONS:
        start = text.index(f"\n{HELP_SECTIONS[section.name]}:\n")
        end = min([w for w in where if w > start] + [text.index("\nexamples:")])
        for name in section.fields:
            assert f"  {flag(name)}" in text[start:end], (section.name, name)
    assert len(OPTIONS) == sum(len(s.fields) for s in ALL_SECTIONS)
    assert text.rstrip().endswith(EXAMPLES.splitlines()[-1]) and "\nexamples:\n" in text
    from hpctrain.cli import build_parser

    parser = build_parser()
    for line in EXAMPLES.splitlines()[1:-1]:
        words = shlex.split(line.split("#")[0])
        args = parser.parse_args(words[words.index("hpctrain") + 1:])  # exits 2 on a flag that is gone
        assert args.command == "train"


@pytest.mark.timeout(180)
def test_dry_run_tries_everything_once_and_writes_nothing(comm, tmp_path, capsys):
    from hpctrain.cli import main

    base = Path(comm.bcast_obj(str(tmp_path) if comm.rank == 0 else None))
    run = base / "run"
    assert main(["train", *TINY, "--dry-run", "--run-dir", str(run)]) == 0
    out = comm.bcast_obj(capsys.readouterr().out)
    assert not run.exists() and not [p for p in base.iterdir() if p.name.startswith(".hpctrain-dry-run")]
    if comm.rank == 0:
        assert "dry run: the data, the model and the trainer build; one step, one evaluation and a checkpoint " \
               "round trip work" in out, out
        assert "written and loaded back bitwise" in out and "held-out samples" in out
        assert "a full run would: start fresh, train 12 step(s) to step 12 (2 epoch(s) of 6 steps)" in out, out
    # On a run that has checkpoints: it loads the newest and changes nothing there.
    assert main(["train", *TINY, "--run-dir", str(run)]) == 0
    capsys.readouterr()
    before = comm.bcast_obj({p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()} if comm.rank == 0 else 0)
    assert main(["train", "--run-dir", str(run), "--resume", "--epochs", "3", "--dry-run"]) == 0
    out = comm.bcast_obj(capsys.readouterr().out)
    if comm.rank == 0:
        assert f"resume from {run / 'checkpoints' / 'ckpt-00000012.h5'} (it loads) at step 12, train 6 step(s) " \
               "to step 18" in out, out
        assert {p.name: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
        assert json.loads((run / "config.json").read_text())["epochs"] == 2  # the dry run kept nothing
