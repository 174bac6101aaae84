"""`hpctrain train`'s configuration in sections: every setting belongs to one section, each rule
is checked by one section only, and a refusal reads the same from a flag and from a TOML file."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from hpctrain import errors, nn
from hpctrain.cli import main as cli_main
from hpctrain.errors import ExitStatus
from hpctrain.train import OPTIONS, read_config, resolve
from hpctrain.train.config import ALL_SECTIONS
from hpctrain.train.models import build_classifier, classifier_pieces, splits

# (owning section, flags, the same settings as TOML, a valid config to start from, message)
CASES = [
    ("model", ["--model", "gpt", "--loss", "mse"], 'model = "gpt"\nloss = "mse"\n', {"model": "gpt"},
     "--model gpt predicts the next token: it trains with --loss ce"),
    ("data", ["--val-fraction", "1.5"], "val_fraction = 1.5\n", {},
     "--val-fraction must be between 0 and 1, got 1.5"),
    ("parallel", ["--zero", "5"], "zero = 5\n", {}, "--zero must be 0, 1, 2 or 3, got 5"),
    ("parallel", ["--strategy", "tp", "--pp", "2"], 'strategy = "tp"\npp = 2\n', {"strategy": "tp"},
     "--strategy tp does not use --pp: use --strategy hybrid for tp x pp x dp"),
    ("optim", ["--strategy", "ps", "--optimizer", "adam"], 'strategy = "ps"\noptimizer = "adam"\n',
     {"strategy": "ps"}, "--strategy ps applies SGD on the servers: --optimizer adam is not possible"),
    ("optim", ["--lr", "nan"], 'lr = nan\n', {}, "--lr nan is not a finite number"),
    ("checkpoint", ["--resume", "--restart"], "resume = true\nrestart = true\n", {},
     "--resume continues the run and --restart starts it over: give one of them"),
    ("precision", ["--grad-reduce-dtype", "bf16"], 'grad_reduce_dtype = "bf16"\n', {},
     "--grad-reduce-dtype bf16 needs --precision bf16-mixed or fp16-mixed"),
    ("reduction", ["--backend", "nccl", "--device", "cpu"], 'backend = "nccl"\ndevice = "cpu"\n', {},
     "--backend nccl reduces on GPUs: it needs --device cuda (or auto on GPU nodes)"),
    ("runtime", ["--epochs", "0"], "epochs = 0\n", {}, "--epochs must be >= 1, got 0"),
]
IDS = [f"{c[0]}:{' '.join(c[1])}" for c in CASES]


def test_every_setting_belongs_to_exactly_one_section():
    owned = [f for s in ALL_SECTIONS for f in s.fields]
    assert sorted(owned) == sorted(o.name for o in OPTIONS)  # each once, none left out
    assert {c[0] for c in CASES} == {s.name for s in ALL_SECTIONS}  # the table covers every section


@pytest.mark.parametrize("section, argv, toml, good, message", CASES, ids=IDS)
def test_each_rule_is_checked_by_its_section_only(tmp_path, section, argv, toml, good, message):
    # A resolved, valid configuration with the bad settings put in: run alone, exactly the owning
    # section refuses it; no other section checks the same rule again.
    world = 2
    (tmp_path / "bad.toml").write_text(toml)
    bad = resolve(good, world).replace(**read_config(str(tmp_path / "bad.toml")))
    refusals = []
    for s in ALL_SECTIONS:
        c = dataclasses.replace(bad)
        try:
            s.check_values(c)
            s.rules(c, world)
        except errors.ConfigError as exc:
            refusals.append((s.name, str(exc)))
    assert refusals == [(section, message)]


@pytest.mark.parametrize("section, argv, toml, good, message", CASES, ids=IDS)
def test_a_refusal_reads_the_same_from_flags_and_from_toml(comm, tmp_path, capsys, section, argv, toml, good,
                                                           message):
    # The real command line, on every rank: refused before anything starts (exit 4), the same words.
    path = tmp_path / "bad.toml"
    path.write_text(toml)
    said = []
    common = ["--run-dir", str(tmp_path / "run"), "--batch-size", str(8 * comm.size)]  # splits over any world
    for args in (argv, ["--config", str(path)]):
        assert cli_main(["train", *common, *args]) == ExitStatus.CONFIG
        said.append(capsys.readouterr().err)
    if comm.rank == 0:  # the error is said once, by rank 0
        assert all(message in s for s in said), said
        assert said[0] == said[1]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("n_layers", [1, 3])
def test_the_layout_checks_ask_the_models_what_they_split(n_layers):
    # The config checks' figures (models.splits) are the built models' own, not a restatement.
    c = resolve({"model": "gpt", "n_layers": n_layers, "d_model": 24, "n_heads": 2, "block_size": 8}, 1)
    gpt = nn.GPT(11, c.block_size, c.d_model, c.n_heads, c.n_layers, rng=0)
    s = splits(c)
    assert s.pipeline_pieces == len(gpt.pipeline_cuts())
    block = getattr(gpt.blocks, gpt.blocks.layer_names[0])
    assert s.tp_sizes == {"n_heads": block.attn.n_heads, "hidden": block.mlp.fc1.weight.shape[1]}

    c = resolve({"model": "mlp", "n_layers": n_layers, "d_model": 8}, 1)
    mlp = build_classifier(c, {"n_in": 5, "n_classes": 3})
    s = splits(c)
    assert s.pipeline_pieces == classifier_pieces(n_layers) == len(mlp.layer_names)
    widths = {m.fc1.weight.shape[1] for _, m in mlp.named_modules() if isinstance(m, nn.MLP)}
    assert widths == {s.tp_sizes["hidden"]}
    assert np.isfinite(mlp.forward(np.zeros((2, 5), np.float32))).all()
