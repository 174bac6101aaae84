"""Cross-rank agreement: silent when ranks agree, a named difference on every rank when not."""

from __future__ import annotations

import pytest

from hpctrain.comm.validate import _first_difference, agree, describe_model, digest, rank_ranges
from hpctrain.errors import MismatchError


def test_digest_is_order_independent_for_dicts():
    assert digest({"a": 1, "b": [1, 2]}) == digest({"b": [1, 2], "a": 1})
    assert digest({"a": 1}) != digest({"a": 2})


def test_first_difference_names_the_path():
    a = {"model": [["fc1.weight", [4, 8], "float32"]], "lr": 0.1}
    b = {"model": [["fc1.weight", [4, 9], "float32"]], "lr": 0.1}
    assert _first_difference(a, b) == "model[0][1][1]: 8 != 9"
    assert "lr: 0.1 != missing" == _first_difference({"lr": 0.1}, {})


def test_ranges():
    assert rank_ranges([0, 1, 2, 5]) == "0-2,5"
    assert rank_ranges([3]) == "3"


def test_describe_model_sorted():
    from hpctrain.nn import Linear, Sequential

    m = Sequential(Linear(2, 3, rng=0), Linear(3, 1, rng=0))
    names = [row[0] for row in describe_model(m)]
    assert names == sorted(names) and ["0.weight", [2, 3], "float32"] in describe_model(m)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_agree_passes_when_equal(comm):
    agree(comm, "config", {"lr": 0.1, "layers": [1, 2]})


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_agree_raises_on_every_rank(comm):
    value = {"lr": 0.1, "width": 8 if comm.rank != comm.size - 1 else 9}
    with pytest.raises(MismatchError) as info:
        agree(comm, "trainer config", value)
    msg = str(info.value)
    assert "trainer config" in msg and f"rank {comm.size - 1}" in msg and "width: 8 != 9" in msg


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_raise_if_any_carries_a_payload_in_the_same_exchange(comm):
    from hpctrain.comm.validate import raise_if_any

    got = raise_if_any(comm, None, what="check", payload={"rank": comm.rank})
    assert got == [{"rank": r} for r in range(comm.size)]
    with pytest.raises(ValueError, match=f"check: rank {comm.size - 1}: bad"):
        raise_if_any(comm, "bad" if comm.rank == comm.size - 1 else None, what="check", payload=comm.rank)
