"""The README's and docs/own-model.md's examples of a model of one's own (issue 36, item 7), run as
written: the forward-only model from the command line (one process, dp and --pp 2 under MPI,
equal to one process), from a script, the fused ``Function`` checked with ``gradcheck``; and
``examples/custom_model.py``'s forward-only layer learning beside its explicit one."""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path

import numpy as np
import pytest

from hpctrain.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Few steps of the built-in classification set: as options, and as the flags that say them.
SMALL = {"epochs": 1, "max_samples": 256, "batch_size": 32, "d_model": 16, "log_every": 100}
FAST = [a for k, v in SMALL.items() for a in (f"--{k.replace('_', '-')}", str(v))]


def blocks(doc: str) -> dict[str, str]:
    """``{marker: code}`` of the code blocks a ``<!-- the ... example: ... -->`` marker names."""
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    found = re.findall(r"<!-- the ([\w -]+?) example: tests/test_own_model.py runs this block as written -->\n"
                       r"```python\n(.*?)```", text, re.S)
    return dict(found)


def commands(doc: str, prefix: str) -> list[list[str]]:
    """The ``hpctrain`` arguments of the lines of ``doc``'s bash blocks that start with ``prefix``."""
    text = open(os.path.join(ROOT, doc), encoding="utf-8").read()
    lines = [ln.split("#")[0].strip() for b in re.findall(r"```bash\n(.*?)```", text, re.S) for ln in b.splitlines()]
    return [shlex.split(ln)[shlex.split(ln).index("hpctrain") + 1 :] for ln in lines if ln.startswith(prefix)]


@pytest.fixture
def mymodel(tmp_path, monkeypatch):
    """The README's ``mymodel.py`` written into a fresh directory, which is the working directory."""
    (tmp_path / "mymodel.py").write_text(blocks("README.md")["forward-only"])
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("mymodel", None)


def test_the_readme_and_the_docs_show_one_example():
    readme, docs = blocks("README.md"), blocks("docs/own-model.md")
    assert readme["forward-only"] == docs["forward-only"]
    assert set(docs) == {"forward-only", "script", "Function"}
    assert "backward" not in readme["forward-only"].replace("no backward written", "")


def test_the_script_example_trains(mymodel, capsys):
    exec(compile(blocks("docs/own-model.md")["script"], "script", "exec"), {})
    loss = float(re.search(r"loss ([\d.]+)", capsys.readouterr().out).group(1))
    assert loss < 0.9 * np.log(3)  # below chance's cross-entropy after 50 steps


def test_the_function_example_passes_gradcheck_and_a_wrong_backward_does_not():
    from hpctrain import autograd as ag
    from hpctrain.errors import GradcheckError

    scope: dict = {}
    exec(compile(blocks("docs/own-model.md")["Function"], "function", "exec"), scope)
    op = scope["GatedTanh"]

    class Wrong(op):
        @staticmethod
        def backward(ctx, g):
            t, s = ctx.saved_tensors
            return g * s, g * t * s * (1 - s)  # the tanh's derivative left out

    a = ag.Tensor(np.linspace(-2, 2, 12).reshape(3, 4), requires_grad=True)
    with pytest.raises(GradcheckError, match="input 0"):
        ag.gradcheck(Wrong.apply, (a, ag.Tensor(np.ones((3, 4)), requires_grad=True)))


def test_the_forward_only_model_trains_from_the_command_line(mymodel, shared_dir, comm):
    run_dir = Path(shared_dir) / "run"  # one run directory for every rank (main is collective)
    more = ["--epochs", "2", "--max-samples", "1024"]
    assert main(["train", "--model", "mymodel.py:build", *FAST, *more, "--run-dir", str(run_dir)]) == 0
    comm.barrier()  # rank 0 has written the summary
    summary = json.load(open(run_dir / "summary.json"))
    assert summary["val_accuracy"] > 0.5, summary  # six classes: chance is 1/6


def test_the_user_model_s_forward_only_layer_learns(shared_dir, comm):
    import h5py

    user = os.path.join(ROOT, "examples", "custom_model.py") + ":build"
    run = Path(shared_dir) / "u"  # one run directory for every rank (main is collective)
    assert main(["train", "--model", user, *FAST, "--run-dir", str(run)]) == 0
    comm.barrier()  # rank 0 has written the summary
    with h5py.File(json.load(open(run / "summary.json"))["checkpoint"], "r") as f:
        gain, scale = f["model/3.g"][()], f["model/2.s"][()]
    assert not np.allclose(gain, 0.5) and not np.allclose(scale, 1.0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_the_readme_commands_under_mpi_match_one_process(comm, shared_dir, monkeypatch):
    """``mpiexec -n 2 hpctrain train --model mymodel.py:build`` (dp) and ``... --pp 2`` as the README
    writes them, on this job's ranks: each ends where one process ends."""
    where = os.path.join(shared_dir, "own")
    if comm.rank == 0:
        os.makedirs(where, exist_ok=True)
        with open(os.path.join(where, "mymodel.py"), "w") as f:
            f.write(blocks("README.md")["forward-only"])
    comm.barrier()
    monkeypatch.chdir(where)
    runs = commands("README.md", "mpiexec -n 2 hpctrain train --model mymodel.py:build")
    assert [r[3:] for r in runs] == [[], ["--pp", "2"]]  # dp, then two pipeline stages
    if comm.size % 2:
        runs = runs[:1]  # two stages need an even world
    from test_train_mpi import serial

    ref = serial(comm, {**SMALL, "model": "mymodel.py:build"}, where)
    for i, args in enumerate(runs):
        assert main([*args, *FAST, "--run-dir", f"mpi-{i}"]) == 0
        comm.barrier()  # rank 0 writes the summary last
        s = json.load(open(f"mpi-{i}/summary.json"))
        assert s["final_loss"] == pytest.approx(ref["final_loss"], rel=1e-4), args
        assert s["val_loss"] == pytest.approx(ref["val_loss"], rel=1e-4), args
