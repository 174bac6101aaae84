"""`hpctrain train`'s configuration in sections: every setting belongs to one section, each rule
is checked by one section only, and a refusal reads the same from a flag and from a TOML file."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

from hpctrain import errors, nn
from hpctrain.cli import main as cli_main
from hpctrain.errors import ExitStatus
from hpctrain.job import OPTIONS, read_config, resolve
from hpctrain.job.config import ALL_SECTIONS
from hpctrain.job.models import build_classifier, classifier_pieces, splits
from hpctrain.job.options import as_flag
from hpctrain.training.precision import Precision

# (owning section, flags, the same settings as TOML, a valid config to start from, message)
CASES = [
    ("model", ["--model", "gpt", "--loss", "mse"], 'model = "gpt"\nloss = "mse"\n', {"model": "gpt"},
     "--model gpt predicts the next token: it trains with --loss ce"),
    ("model", ["--model", "mlp", "--tie-embeddings"], 'model = "mlp"\ntie_embeddings = true\n', {"model": "mlp"},
     "--tie-embeddings ties the GPT's head to its token embedding; --model mlp has none (a model of your own "
     "ties its weights itself)"),
    ("model", ["--loss", "mse"], 'loss = "mse"\n', {},
     "--loss mse trains on float targets, and the built-in data sets hold class indices: train them with --loss "
     "ce, or give --data FILE whose --y-key holds float values"),
    ("model", ["--seed", "-1"], "seed = -1\n", {}, "--seed must be >= 0, got -1"),
    ("model", ["--model", "gpt", "--moe-experts", "2", "--moe-top-k", "3"],
     'model = "gpt"\nmoe_experts = 2\nmoe_top_k = 3\n', {"model": "gpt"},
     "--moe-top-k 3 must be between 1 and --moe-experts 2"),
    ("data", ["--val-fraction", "1.5"], "val_fraction = 1.5\n", {},
     "--val-fraction must be between 0 and 1, got 1.5"),
    ("parallel", ["--zero", "5"], "zero = 5\n", {}, "--zero must be 0, 1, 2 or 3, got 5"),
    ("parallel", ["--strategy", "tp", "--pp", "2"], 'strategy = "tp"\npp = 2\n', {"strategy": "tp"},
     "--strategy tp does not use --pp: use --strategy hybrid for tp x pp x dp"),
    ("parallel", ["--pp-cut", "3"], 'pp_cut = "3"\n', {},
     "--pp-cut 3 says where pipeline stages begin, but pp=1: give --pp 2 or more (or --pp-cut auto)"),
    ("parallel", ["--layout", "auto", "--strategy", "ps"], 'layout = "auto"\nstrategy = "ps"\n', {"strategy": "ps"},
     "--layout auto plans the synchronous layouts (dp, tp, pp, ZeRO); --strategy ps is not one: drop one of them"),
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


# -- each rule in one place: the library owns it, the command line asks it with its flags ---------


def _engine(comm, **kw):
    from hpctrain.comm.grid import ProcessGrid
    from hpctrain.optim import SGD
    from hpctrain.parallel import ParallelTrainer

    model = nn.Sequential(nn.Linear(4, 3, rng=0))
    return ParallelTrainer(model=model, loss=nn.MSELoss(), optimizer=SGD(model.parameters(), lr=0.1),
                           grid=ProcessGrid(comm), **kw)


def _ps(comm, **kw):
    from hpctrain.parallel import ParameterServerTrainer

    return ParameterServerTrainer(model=nn.Sequential(nn.Linear(4, 3, rng=0)), loss=nn.MSELoss(), lr=0.1, comm=comm,
                                  **kw)


def _shrinkable(trainer):
    """``RankLoss``'s check of the trainer it is handed (the trainer closed after it)."""
    from hpctrain.resilience import check_shrinkable

    try:
        check_shrinkable(trainer)
    finally:
        trainer.close()


def _tp(comm, module):
    from hpctrain.parallel import tensor_parallel

    return tensor_parallel(module, comm)


def _heads(comm):
    return comm.size + 1  # never divisible by the tensor-parallel size


# (rule, the library refusing it (comm -> raises), the settings `hpctrain train` refuses for it, the
# world resolve() takes (None: the comm's), the argument names the two word differently)
SAME_RULE = [
    ("zero stage", lambda comm: _engine(comm, zero=5), lambda comm: {"zero": 5}, 2, ("zero",)),
    ("zero reduces alone (compression)", lambda comm: _engine(comm, zero=1, compression="bf16"),
     lambda comm: {"zero": 1, "compression": "bf16"}, 2, ("zero", "compression")),
    ("zero reduces alone (backend)", lambda comm: _engine(comm, zero=2, backend="hierarchical"),
     lambda comm: {"zero": 2, "backend": "hierarchical"}, 2, ("zero", "backend")),
    ("compression is flat MPI's", lambda comm: _engine(comm, compression="bf16", backend="hierarchical"),
     lambda comm: {"compression": "bf16", "backend": "hierarchical"}, 2, ("compression", "backend")),
    ("mixed precision takes no compression", lambda comm: _engine(comm, precision="bf16-mixed", compression="fp16"),
     lambda comm: {"precision": "bf16-mixed", "compression": "fp16"}, 2,
     ("precision", "grad_reduce_dtype", "compression")),
    ("clip norm", lambda comm: _engine(comm, clip_norm=0.0), lambda comm: {"clip_norm": 0.0}, 2, ("clip_norm",)),
    ("16-bit reduce needs mixed precision", lambda comm: Precision("fp32", "bf16"),
     lambda comm: {"grad_reduce_dtype": "bf16"}, 2, ("precision", "grad_reduce_dtype", "compression")),
    ("bf16 gradients overflow fp16", lambda comm: Precision("bf16-mixed", "fp16"),
     lambda comm: {"precision": "bf16-mixed", "grad_reduce_dtype": "fp16"}, 2, ("precision", "grad_reduce_dtype")),
    ("ssp staleness", lambda comm: _ps(comm, mode="ssp", staleness=-1),
     lambda comm: {"strategy": "ps", "ps_mode": "ssp", "staleness": -1}, 2, ("staleness",)),
    ("server momentum", lambda comm: _ps(comm, mode="ssp", momentum=0.5),
     lambda comm: {"strategy": "ps", "ps_mode": "ssp", "momentum": 0.5}, 2, ("momentum", "mode")),
    ("heads divide the width", lambda comm: nn.CausalSelfAttention(30, 4, rng=0),
     lambda comm: {"model": "gpt", "d_model": 30, "n_heads": 4}, 2, ("n_heads", "d_model")),
    ("dropout", lambda comm: nn.Dropout(1.0), lambda comm: {"dropout": 1.0}, 2, ("dropout",)),
    ("shrink keeps data-parallel replicas", lambda comm: _shrinkable(_ps(comm)),
     lambda comm: {"on_rank_loss": "shrink", "strategy": "ps"}, 2,
     ("on_rank_loss", "strategy", "zero", "backend", "precision")),
    ("tp divides the heads", lambda comm: _tp(comm, nn.TransformerBlock(4 * _heads(comm), _heads(comm), 8, rng=0)),
     lambda comm: {"model": "gpt", "strategy": "tp", "n_heads": _heads(comm), "d_model": 4 * _heads(comm),
                   "batch_size": 8}, None, ("n_heads",)),
]


def _in_common_words(text, names, flags):
    """``text`` with each argument name as ``<name>``: ``zero=5`` (the library's) and ``--zero 5``
    (the command line's) both read ``<zero> 5``."""
    for name in names:
        if flags:
            text = text.replace(as_flag(name), f"<{name}>")
        else:
            # (not a name in prose: "the flat MPI backend" stays words on both sides)
            text = re.sub(rf"(?<![\w<-])(?<!MPI ){name}(?:=('?)([^'\s,):]+)\1)?(?![\w-])",
                          lambda m, n=name: f"<{n}>" + (f" {m.group(2)}" if m.group(2) else ""), text)
    return text


@pytest.mark.parametrize("rule, library, settings, world, names", SAME_RULE, ids=[r[0] for r in SAME_RULE])
def test_the_library_and_the_command_line_refuse_a_rule_in_the_same_words(comm, rule, library, settings, world,
                                                                          names):
    # One check function per rule, next to its class; the configuration asks the same function with
    # its flags' names (as_flag). So the command line's refusal, names aside, is the library's
    # words: a rule reworded (or re-checked) on one side only fails here.
    if world is None and comm.size < 2:
        pytest.skip("a tensor-parallel refusal needs a group of 2 or more ranks")
    with pytest.raises(ValueError) as lib:
        library(comm)
    with pytest.raises(errors.ConfigError) as cli:
        resolve(settings(comm), comm.size if world is None else world)
    said = _in_common_words(str(cli.value), names, flags=True)
    assert said in _in_common_words(str(lib.value), names, flags=False), (str(cli.value), str(lib.value))
    assert "--" not in str(lib.value)  # the library speaks of its arguments, not of flags


def test_the_flags_choices_are_the_librarys_names():
    # Choices the config cannot import without starting MPI are written out: they must stay the library's.
    from hpctrain.comm.buckets import COMPRESSIONS
    from hpctrain.parallel.engine import BACKENDS
    from hpctrain.parallel.pipeline_schedules import get_schedule
    from hpctrain.parallel.ps_args import MODES
    from hpctrain.training.guard import POLICIES
    from hpctrain.training.precision import PRECISIONS, REDUCE_DTYPES

    choices = {o.name: o.choices for o in OPTIONS}
    assert choices["backend"] == BACKENDS and choices["ps_mode"] == MODES and choices["on_nonfinite"] == POLICIES
    assert choices["compression"] == tuple(c for c in COMPRESSIONS if c is not None)
    assert choices["precision"] == PRECISIONS and choices["grad_reduce_dtype"] == REDUCE_DTYPES
    for name in choices["schedule"]:  # the flag offers the schedules that need no --virtual-stages
        get_schedule(name)
