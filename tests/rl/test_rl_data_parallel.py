"""The bookkeeping of data-parallel RL that needs no second process: dealing tasks to ranks, and parked groups
gathered into one checkpoint and dealt back to the ranks that held them."""

from k3.rl.data_parallel import Ranks, merge_parked, parked_share


def group(name, snapshot=None):
    return [{"task": name, "parked_snapshot": snapshot, "done": snapshot is None}]


def test_a_world_of_one_keeps_everything():
    ranks = Ranks("cpu")
    assert (ranks.rank, ranks.world, ranks.main, ranks.device) == (0, 1, True, None)
    assert ranks.share(["a", "b", "c"]) == (["a", "b", "c"], [0, 1, 2])
    assert ranks.gather({"x": 1}) == [{"x": 1}] and ranks.any(True) and not ranks.any(False)


def test_tasks_are_dealt_round_robin():
    ranks = Ranks("cpu")
    ranks.rank, ranks.world = 1, 3
    assert ranks.share(list("abcdefg")) == (["b", "e"], [1, 4])


def test_parked_groups_go_back_to_the_rank_that_held_them():
    states = [{"groups": [group("a", "s1"), group("b")], "snapshots": {"s1": {"layers": 1}}},
              {"groups": [group("c", "s2")], "snapshots": {"s2": {"layers": 2}}}]
    merged = merge_parked(states)
    assert merged["ranks"] == [0, 0, 1] and merged["world"] == 2
    assert parked_share(merged, 0, 2) == {"groups": [group("a", "s1"), group("b")], "snapshots": {"s1": {"layers": 1}}}
    assert parked_share(merged, 1, 2) == {"groups": [group("c", "s2")], "snapshots": {"s2": {"layers": 2}}}
    # Another world size: every world-th group, each with the snapshots it needs.
    assert [g[0]["task"] for g in parked_share(merged, 0, 1)["groups"]] == ["a", "b", "c"]
    assert parked_share(merged, 1, 3) == {"groups": [group("b")], "snapshots": {}}
    # A one-process checkpoint's parked state (RolloutRunner.parked_state) is read as well.
    assert parked_share(states[0], 0, 1)["groups"] == states[0]["groups"]
