"""`hpctrain train`'s mixture-of-experts flags (`--moe-*`, `--ep`): refused in one line on every
rank before anything starts, and what the header and the layout say of them."""

from __future__ import annotations

import pytest

from hpctrain.cli import main as cli_main
from hpctrain.errors import ConfigError, ExitStatus
from hpctrain.job import resolve
from hpctrain.job.config import layout_text
from hpctrain.job.runner import moe_text


def _refusals(world: int) -> list[tuple[list[str], str]]:
    """(flags, the refusal) on ``world`` ranks (>= 2), its figures derived from the world."""
    return [
        (["--model", "gpt", "--moe-experts", str(2 * world + 1), "--ep", "2"],
         f"--moe-experts {2 * world + 1} must be divisible by --ep 2"),
        (["--model", "gpt", "--moe-experts", str(4 * world), "--ep", str(2 * world)],
         f"--ep {2 * world} must divide the data-parallel replicas (dp={world}): the expert-parallel groups are "
         "carved out of dp"),
        (["--model", "gpt", "--ep", "2"],
         "--ep 2 spreads the experts of a mixture-of-experts model, and --model gpt has none: give --moe-experts "
         "(gpt)"),
        (["--model", "gpt", "--moe-experts", "2", "--moe-top-k", "3"],
         "--moe-top-k 3 must be between 1 and --moe-experts 2"),
        (["--model", "gpt", "--moe-experts", "4", "--ep", "2", "--tp", str(world)],
         "--ep 2 must divide the data-parallel replicas (dp=1): the expert-parallel groups are carved out of dp"),
        (["--model", "mlp", "--moe-experts", "4"],
         "--moe-experts makes the GPT's MLPs mixtures of experts; --model mlp has none (a model of your own puts "
         "nn.MoE layers in itself)"),
        (["--strategy", "ps", "--ep", "2"],
         "--strategy ps does not use --ep 2: use --strategy hybrid for tp x pp x dp"),
        (["--strategy", "dp", "--model", "gpt", "--moe-experts", "4", "--ep", "2"],
         "--strategy dp does not use --ep 2: use --strategy hybrid for tp x pp x dp"),
    ]


def _as_settings(argv: list[str]) -> dict:
    """``["--moe-experts", "4", ...]`` as resolve's settings."""
    out = {}
    for key, value in zip(argv[::2], argv[1::2]):
        name = key[2:].replace("-", "_")
        out[name] = value if name in ("model", "strategy") else int(value)
    return out


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("case", range(8))
def test_each_moe_refusal_is_one_line_that_says_what_is_wrong(world, case):
    argv, message = _refusals(world)[case]
    with pytest.raises(ConfigError) as exc:
        resolve(_as_settings(argv), world)
    assert str(exc.value) == message
    assert "\n" not in message


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("case", range(8))
def test_the_command_refuses_them_on_every_rank_before_anything_starts(comm, tmp_path, capsys, case):
    run = tmp_path / "run"
    argv, message = _refusals(comm.size)[case]
    status = cli_main(["train", "--run-dir", str(run), "--batch-size", str(8 * comm.size), *argv])
    assert status == ExitStatus.CONFIG  # on every rank
    if comm.rank == 0:
        assert message in capsys.readouterr().err
    assert not run.exists()


def test_a_valid_moe_layout_resolves_to_hybrid_with_ep_carved_out_of_dp():
    c = resolve({"model": "gpt", "moe_experts": 4, "ep": 2, "tp": 2}, 8)
    assert (c.strategy, c.dp, c.ep, c.tp, c.pp) == ("hybrid", 4, 2, 2, 1)  # ep inside dp, with tp
    c = resolve({"model": "gpt", "moe_experts": 4, "ep": 2}, 4)
    assert (c.strategy, c.dp, c.ep, c.tp, c.pp) == ("hybrid", 4, 2, 1, 1)
    assert layout_text(c.dp, c.tp, c.pp, c.zero, ep=c.ep) == "dp=4 tp=1 pp=1 ep=2"
    assert layout_text(c.dp, c.tp, c.pp, 0) == "dp=4 tp=1 pp=1"  # a layout without ep reads as before
    assert moe_text(c) == ("4 experts, top-2, in every block, dropless, load-balancing loss weight 0.01; "
                           "2 experts per rank over ep=2")
