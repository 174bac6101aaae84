"""`hpctrain train` configuration: defaults < TOML file < flags, and refusals before training."""

from __future__ import annotations

import pytest

from hpctrain import errors
from hpctrain.cli import build_parser
from hpctrain.job import merge, read_toml, resolve


def flags(*argv: str) -> dict:
    return vars(build_parser().parse_args(["train", *argv]))


def cfg(*argv: str, file: dict | None = None) -> dict:
    return merge(file or {}, flags(*argv))


def test_defaults_are_data_parallel_mlp_adamw():
    c = resolve(cfg(), world=2)
    assert (c.strategy, c.model, c.optimizer) == ("dp", "mlp", "adamw")
    assert (c.dp, c.tp, c.pp) == (2, 1, 1)
    assert c.local_batch * c.dp == c.batch_size
    assert c.lr == 3e-3


def test_only_given_flags_override(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('epochs = 7\nlr = 0.01\nmodel = "gpt"\n[train]\nbatch-size = 32\n')
    file_values = read_toml(str(path))
    assert file_values == {"epochs": 7, "lr": 0.01, "model": "gpt", "batch_size": 32}
    c = cfg("--lr", "0.5", file=file_values)
    assert c.lr == 0.5  # flag beats file
    assert c.epochs == 7 and c.model == "gpt" and c.batch_size == 32  # file beats defaults
    assert c.seed == 0  # default where neither says


def test_config_flag_is_parsed_and_bool_flags():
    f = flags("--config", "x.toml", "--resume", "--tp", "2")
    assert f["config"] == "x.toml" and f["resume"] is True and f["tp"] == 2
    assert "epochs" not in f  # not given: the file or the default decides
    assert flags("--no-resume")["resume"] is False


@pytest.mark.parametrize(
    "text, message",
    [
        ("epoch = 3\n", "unknown key 'epoch' (did you mean 'epochs'?)"),
        ('epochs = "3"\n', "epochs must be int"),
        ("lr = true\n", "lr must be float"),
        ('strategy = "zero"\n', "strategy must be one of dp, tp, pp, ps, hybrid"),
        ("epochs = [\n", "not valid TOML"),
    ],
)
def test_bad_toml_refused(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(errors.ConfigError) as exc:
        read_toml(str(path))
    assert message in str(exc.value) and str(path) in str(exc.value)


@pytest.mark.parametrize("text, message", [
    ("batch-size = 8\nbatch_size = 16\n", "'batch-size' and 'batch_size' both set batch_size: keep one"),
    ("epochs = 2\n[train]\nepochs = 5\n", "'epochs' and 'train.epochs' both set epochs: keep one"),
])
def test_a_setting_given_twice_in_one_file_is_refused(tmp_path, text, message):
    """Before, the later spelling won without a word (the user's other value silently ignored)."""
    path = tmp_path / "twice.toml"
    path.write_text(text)
    with pytest.raises(errors.ConfigError, match=message):
        read_toml(str(path))


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_non_finite_min_lr_is_refused(tmp_path, value):
    """A NaN --min-lr passed the config's checks (NaN < 0 and NaN > lr are false) and was refused
    only when the job built its schedule, as a ValueError after the start, not a config refusal."""
    path = tmp_path / "lr.toml"
    path.write_text(f'min_lr = {value}\nlr_schedule = "cosine"\n')
    with pytest.raises(errors.ConfigError, match=f"--min-lr {value} is not a finite number"):
        resolve(merge(read_toml(str(path)), {}), world=2)


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_config_that_is_not_a_regular_file_is_refused(serial, tmp_path, kind):
    """Before, --config naming a FIFO blocked in open() for good (even timeout's SIGTERM waited on
    it), so the check runs in a process of its own with a time limit."""
    import os
    import subprocess
    import sys

    path = tmp_path / "run.toml"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    code = "import sys; from hpctrain.job import read_toml; read_toml(sys.argv[1])"
    try:
        p = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"reading a config that is a {kind} hung")
    what = "a FIFO" if kind == "fifo" else "a directory"
    assert f"ConfigError: config file {path} cannot be read: it is {what}, not a regular file" in p.stderr, p.stderr


def test_missing_toml_refused(tmp_path):
    with pytest.raises(errors.ConfigError, match="does not exist"):
        read_toml(str(tmp_path / "nope.toml"))


def test_bad_flag_value_exits_with_usage(capsys):
    with pytest.raises(SystemExit) as exc:
        flags("--strategy", "zero")
    assert exc.value.code == 2
    assert "invalid choice: 'zero'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, world, message",
    [
        (["--strategy", "hybrid", "--tp", "2"], 3, "3 ranks do not factor into tp=2 x pp=1"),
        (["--strategy", "hybrid", "--pp", "4"], 6, "must be a multiple of 4"),
        (["--strategy", "dp", "--tp", "2"], 4, "--strategy dp does not use --tp 2: use --strategy hybrid"),
        (["--strategy", "tp", "--pp", "2"], 4, "--strategy tp does not use --pp"),
        (["--strategy", "pp", "--tp", "2"], 4, "--strategy pp does not use --tp"),
        (["--strategy", "ps", "--optimizer", "adam"], 2, "applies SGD on the servers"),
        (["--batch-size", "10"], 4, "does not split over dp=4 replicas: use a multiple of 4"),
        (["--strategy", "pp", "--batch-size", "6", "--microbatches", "4"], 2, "does not split into --microbatches 4"),
        (["--model", "gpt", "--strategy", "tp", "--n-heads", "3", "--d-model", "48"], 2,
         "tp=2 must divide --n-heads 3"),
        (["--model", "gpt", "--d-model", "30", "--n-heads", "4"], 1, "--n-heads 4 must divide --d-model 30"),
        (["--model", "gpt", "--strategy", "pp", "--n-layers", "1"], 8, "pp=8 stages but the gpt model has only 4"),
        (["--strategy", "ps", "--weight-decay", "0.1"], 2, "--weight-decay is not possible"),
        (["--epochs", "0"], 2, "--epochs must be >= 1"),
        (["--lr", "-1"], 2, "--lr must be > 0"),
        (["--val-fraction", "1.5"], 2, "--val-fraction must be between 0 and 1"),
        (["--resume"], 2, "--resume needs the --run-dir"),
        (["--strategy", "ps", "--ps-mode", "ssp", "--momentum", "0.5"], 2, "needs --ps-mode sync"),
        (["--backend", "hierarchical", "--compression", "bf16"], 2, "not --backend hierarchical"),
        (["--strategy", "ps", "--backend", "hierarchical"], 2, "--strategy ps talks through MPI windows"),
    ],
)
def test_impossible_settings_refused(argv, world, message):
    with pytest.raises(errors.ConfigError) as exc:
        resolve(cfg(*argv), world=world)
    assert message in str(exc.value)


@pytest.mark.parametrize(
    "argv, world, layout",
    [
        (["--strategy", "tp"], 4, (1, 4, 1)),
        (["--strategy", "pp"], 2, (1, 1, 2)),
        (["--strategy", "hybrid", "--tp", "2"], 4, (2, 2, 1)),
        (["--strategy", "hybrid", "--pp", "2"], 4, (2, 1, 2)),
        (["--strategy", "ps"], 3, (3, 1, 1)),
        (["--strategy", "hybrid", "--tp", "2", "--pp", "2"], 8, (2, 2, 2)),
        (["--tp", "2", "--pp", "2"], 8, (2, 2, 2)),  # no --strategy: dp inferred
        (["--tp", "2"], 4, (2, 2, 1)),
        ([], 4, (4, 1, 1)),
    ],
)
def test_layouts(argv, world, layout):
    c = resolve(cfg(*argv, "--batch-size", "48"), world=world)
    assert (c.dp, c.tp, c.pp) == layout


def test_ps_defaults_to_sgd():
    c = resolve(cfg("--strategy", "ps"), world=2)
    assert c.optimizer == "sgd" and c.lr == 0.1 and c.momentum == 0.9
    c = resolve(cfg("--strategy", "ps", "--ps-mode", "async"), world=2)
    assert c.optimizer == "sgd" and c.lr == 0.3 and c.momentum == 0.0
