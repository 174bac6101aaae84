"""`hpctrain train --cp N --cp-mode {ring,ulysses}`: the layout it resolves to and its refusals,
each one line naming the flags, decided before anything starts (a pure function of the settings
and the world size, so every rank reaches the same verdict)."""

from __future__ import annotations

import pytest

from hpctrain import errors
from hpctrain.errors import ExitStatus
from hpctrain.job import OPTIONS, resolve
from hpctrain.job.config import LAYOUT_KEYS, LAYOUT_SHAPE, layout_text
from hpctrain.parallel.cp_split import CP_MODES, cp_problem

GPT = {"model": "gpt", "d_model": 32, "n_heads": 4, "block_size": 32, "batch_size": 8}


@pytest.mark.parametrize("settings, world, want", [
    ({"cp": 2}, 2, (1, 1, 2, 1)),
    ({"cp": 2}, 4, (2, 1, 2, 1)),  # dp is what cp leaves
    ({"cp": 2, "tp": 2}, 8, (2, 2, 2, 1)),
    ({"cp": 2, "pp": 2}, 4, (1, 1, 2, 2)),
    ({"cp": 4, "cp_mode": "ulysses"}, 4, (1, 1, 4, 1)),
])
def test_cp_resolves_to_the_hybrid_layout_with_dp_what_is_left(settings, world, want):
    c = resolve({**GPT, **settings}, world)
    assert c.strategy == "hybrid"
    assert (c.dp, c.tp, c.cp, c.pp) == want
    assert c.dp * c.tp * c.cp * c.pp == world
    assert c.local_batch == c.batch_size // c.dp  # the cp ranks of a replica share its batch


def _refusal(settings, world):
    with pytest.raises(errors.ConfigError) as err:
        resolve(settings, world)
    return str(err.value)


def test_cp_refusals_name_what_is_wrong():
    said = _refusal({**GPT, "cp": 2, "block_size": 30}, 2)
    assert "--block-size 30 does not split into 2 x --cp 2 = 4 chunks" in said and "multiple of 4" in said
    said = _refusal({**GPT, "cp": 4, "cp_mode": "ulysses", "n_heads": 2, "d_model": 32}, 4)
    assert "--cp-mode ulysses splits the attention heads" in said and "--n-heads 2 is not divisible by cp = 4" in said
    said = _refusal({**GPT, "cp": 2, "tp": 2, "cp_mode": "ulysses", "n_heads": 2, "d_model": 32}, 4)
    assert "not divisible by tp x cp = 2 x 2" in said
    said = _refusal({**GPT, "cp": 4}, 6)
    assert said == "6 ranks do not factor into tp=1 x pp=1 x cp=4 x dp: the world size must be a multiple of 4"
    for model in ("mlp", "cnn"):
        said = _refusal({"model": model, "cp": 2, "batch_size": 8}, 2)
        assert said.startswith(f"--cp 2 splits each sequence's tokens over the ranks, but --model {model} has no "
                               "attention"), said
    assert "the parameter server" in _refusal({**GPT, "cp": 2, "strategy": "ps"}, 2)
    assert _refusal({**GPT, "cp": 2, "strategy": "dp"}, 2).startswith("--strategy dp does not use --cp 2")
    assert _refusal({**GPT, "cp": 0}, 2) == "--cp must be >= 1, got 0"
    for said in (_refusal({**GPT, "cp": 2, "block_size": 30}, 2), _refusal({"model": "mlp", "cp": 2}, 2)):
        assert "\n" not in said  # one line


def test_the_ring_takes_any_heads_and_ulysses_heads_divisible_by_tp_x_cp():
    ring = resolve({**GPT, "cp": 4, "n_heads": 2, "d_model": 32}, 4)  # the ring never splits heads
    assert ring.cp_mode == "ring"
    uly = resolve({**GPT, "cp": 2, "tp": 2, "cp_mode": "ulysses", "n_heads": 4}, 4)
    assert (uly.cp, uly.tp, uly.cp_mode) == (2, 2, "ulysses")


def test_the_library_rule_speaks_of_arguments():
    said = cp_problem(2, "ring", 30, 4)
    assert said.startswith("block_size=30 does not split into 2 x cp=2 = 4 chunks") and "--" not in said
    assert cp_problem(2, "ulysses", 32, 3).endswith("n_heads=3 is not divisible by cp = 2 (use cp_mode='ring')")
    assert cp_problem(2, "sideways", 32, 4).startswith("cp_mode must be one of ('ring', 'ulysses')")
    assert cp_problem(1, "ulysses", 31, 3) is None  # no cp: nothing to split
    assert cp_problem(2, "ring", None, None) is None  # sizes not known: not checked


def test_cp_is_part_of_the_layout_header_and_flags():
    assert {"cp", "cp_mode"} <= set(LAYOUT_KEYS) and "cp" in LAYOUT_SHAPE  # the job's, not the run's
    assert layout_text(2, 1, 1) == "dp=2 tp=1 pp=1"  # without cp: as before
    assert layout_text(2, 1, 1, 3, cp=2) == "dp=2 tp=1 pp=1 cp=2, ZeRO-3"
    assert layout_text(1, 2, 1, cp=2, cp_mode="ulysses") == "dp=1 tp=2 pp=1 cp=2 ulysses"
    assert {o.name: o.choices for o in OPTIONS}["cp_mode"] == CP_MODES


def test_the_command_line_refuses_cp_before_anything_starts(comm, tmp_path, capsys):
    from hpctrain.cli import main as cli_main

    run = tmp_path / "run"
    argv = ["train", "--run-dir", str(run), "--model", "mlp", "--cp", "2", "--batch-size", str(8 * comm.size)]
    assert cli_main(argv) == ExitStatus.CONFIG
    err = capsys.readouterr().err
    if comm.rank == 0:
        assert "--cp 2 splits each sequence's tokens over the ranks, but --model mlp has no attention" in err \
            or "do not factor" in err, err
    assert not run.exists()
