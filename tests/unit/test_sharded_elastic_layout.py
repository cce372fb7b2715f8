"""The layout of a neighbour's sharded-state copy (ringsync.torch._sharded_elastic) is
checked before anything is allocated for it: a peer's sizes are untrusted."""
import pytest

torch = pytest.importorskip("torch")

from ringsync.errors import RingsyncError  # noqa: E402
from ringsync.torch._sharded_elastic import _checked_layout  # noqa: E402

GOOD = ("optimizer.g0.float32.exp_avg", {"a": 3, "b": 10, "total": 12}, torch.float32)


def test_a_well_formed_layout_passes():
    assert _checked_layout({"pieces": [GOOD, GOOD]}, 4) == [GOOD, GOOD]


@pytest.mark.parametrize("bad", [
    ("k", {"a": 5, "b": 3, "total": 12}, torch.float32),  # b before a
    ("k", {"a": 0, "b": 13, "total": 12}, torch.float32),  # past the tensor's size
    ("k", {"a": -1, "b": 3, "total": 12}, torch.float32),  # negative
    ("k", {"a": 0, "b": 2.5, "total": 12}, torch.float32),  # not an int
    ("k", {"a": 0, "b": 2, "total": 12}, "float32"),  # not a dtype
    ("k", {"a": 0, "b": 2}, torch.float32),  # no size
    ("k", {"a": 0, "b": 2, "total": 12}),  # too short
])
def test_a_malformed_entry_is_refused_naming_the_peer(bad):
    with pytest.raises(RingsyncError, match=r"rank 4 sent a malformed layout .*entry"):
        _checked_layout({"pieces": [GOOD, bad]}, 4)


@pytest.mark.parametrize("theirs", [None, [], {"pieces": None}, {"pieces": "x"}])
def test_no_list_of_pieces_is_refused(theirs):
    with pytest.raises(RingsyncError, match="rank 4 sent a malformed layout"):
        _checked_layout(theirs, 4)
