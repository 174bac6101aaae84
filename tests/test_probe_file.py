"""The saved link probe (``hpctrain info --probe --save FILE``): written and read back whole, and
every damaged or foreign file refused with a message naming the file and the fault (no MPI)."""

from __future__ import annotations

import json
import math
import os

import pytest

from hpctrain.comm.linkprobe import Link
from hpctrain.comm.probefile import FORMAT, MAX_PROBE, load, record, save
from hpctrain.errors import ConfigError

LINKS = {"intra-node": Link((0, 1), 4e-6, 9e9, ((8, 4e-6), (1 << 20, 1.2e-4)), 2e-5),
         "inter-node": Link((0, 2), 3e-5, math.inf, ((8, 3e-5), (1 << 20, 3e-5)), 2e-5)}
NODES = ["a", "a", "b", "b"]


def test_a_saved_probe_loads_as_it_was_measured(tmp_path):
    path = str(tmp_path / "probe.json")
    save(path, LINKS, NODES, "MPICH Version: 5")
    probe = load(path)
    assert probe.links == LINKS  # beta = inf survives JSON (written as null)
    assert probe.nodes == tuple(NODES) and probe.ranks_per_node == {"a": 2, "b": 2}
    assert probe.mpi == "MPICH Version: 5" and probe.date.endswith("Z")
    raw = json.loads(open(path).read())
    assert raw["format"] == FORMAT and raw["links"]["inter-node"]["beta"] is None


def test_one_node_without_an_inter_node_link(tmp_path):
    path = str(tmp_path / "p.json")
    save(path, {"intra-node": LINKS["intra-node"], "inter-node": None}, ["a", "a"], "m")
    assert load(path).links["inter-node"] is None


def _damaged(raw: dict, where: list, value) -> dict:
    x = raw
    for key in where[:-1]:
        x = x[key]
    if value is KeyError:
        del x[where[-1]]
    else:
        x[where[-1]] = value
    return raw


@pytest.mark.parametrize("where,value,words", [
    (["format"], "something else", "not an hpctrain link probe"),
    (["version"], 99, "version 99"),
    (["nodes"], [], "'nodes' must be a non-empty list"),
    (["nodes"], KeyError, "damaged: its field 'nodes' is missing"),
    (["links", "intra-node", "alpha"], -1.0, "alpha'] must be a finite non-negative number"),
    (["links", "intra-node", "beta"], 0, "beta'] must be a finite positive number"),
    (["links", "intra-node", "ranks"], [0, 7], "two different ranks below 4"),
    (["links", "intra-node", "meet"], math.nan, "meet'] must be a finite non-negative number"),
    (["links", "inter-node", "meet"], KeyError, "its field 'meet' is missing"),
    (["links", "intra-node", "samples"], [[8]], "pairs"),
    (["links", "intra-node", "samples"], [[8, "x"]], "a sample's time in intra-node"),
    (["links", "bogus"], None, "exactly the link classes"),
    (["links"], {"intra-node": None, "inter-node": None}, "no link measured"),
    (["mpi"], 3, "'mpi' must be a string"),
])
def test_a_damaged_probe_is_refused_naming_the_fault(tmp_path, where, value, words):
    path = str(tmp_path / "probe.json")
    raw = _damaged(record(LINKS, NODES, "m"), where, value)
    with open(path, "w") as f:
        json.dump(raw, f)
    with pytest.raises(ConfigError, match=words) as e:
        load(path)
    assert path in str(e.value)


@pytest.mark.parametrize("text,words", [("{not json", "not JSON"), ("[1, 2]", "not an object"),
                                        ('{"alpha": 1}', "not an hpctrain link probe")])
def test_a_foreign_file_is_refused(tmp_path, text, words):
    path = tmp_path / "probe.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words):
        load(str(path))


def test_missing_oversized_and_special_files_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist .*hpctrain info --probe --save"):
        load(str(tmp_path / "none.json"))
    big = tmp_path / "big.json"
    with open(big, "wb") as f:
        f.truncate(MAX_PROBE + 1)  # sparse: never read, refused by its size
    with pytest.raises(ConfigError, match="more than the"):
        load(str(big))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="not a regular file"):  # (an open would block)
        load(str(fifo))


def test_an_unwritable_place_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="cannot write the probe"):
        save(str(tmp_path / "no" / "such" / "dir.json"), LINKS, NODES, "m")
