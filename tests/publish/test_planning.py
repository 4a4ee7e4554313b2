"""Rank 0's planning as pure functions over named messages: no store, no coordinator."""

from __future__ import annotations

import pytest

from deltastore.errors import PublishError
from deltastore.publish.config import PublisherConfig
from deltastore.publish.messages import (
    DiffReport,
    Failure,
    Layout,
    Placement,
    PublishResult,
    ShardJob,
    StreamState,
    TensorChange,
    Written,
)
from deltastore.publish.planning import (
    assign_delta,
    assign_full,
    build_index,
    check_written,
    plan_layout,
    version_totals,
    wants_full,
    written_failure,
)

SIZES = {"a": 100, "b": 200, "c": 300, "d": 400}
STREAM = StreamState(stream_id="s1", base_version=4, next_version=5)


def change(digest: str, payload: int = 10, changed: int = 5) -> TensorChange:
    return TensorChange(digest=digest, payload_bytes=payload, changed_bytes=changed)


def report(rank: int, passed: dict[str, TensorChange | None], *, full: bool = False) -> DiffReport:
    return DiffReport(rank=rank, error=None, passed=passed, full=full)


def plan(reports: list[DiffReport], stream: StreamState = STREAM) -> Layout | Failure:
    return plan_layout(reports, stream, SIZES, PublisherConfig(max_shard_bytes=1 << 30))


def test_delta_shards_are_numbered_gap_free_across_the_ranks_that_write():
    layout = plan(
        [report(0, {"a": None}), report(1, {"b": change("x")}), report(2, {"c": change("y")})]
    )
    assert isinstance(layout, Layout) and not layout.full
    assert layout.shards == (
        (),
        (ShardJob("model-00000-of-00002.safetensors", ("b",)),),
        (ShardJob("model-00001-of-00002.safetensors", ("c",)),),
    )
    assert layout.changed == {"b": 5, "c": 5}
    assert layout.owner == {"a": 0, "b": 1, "c": 2}


def test_equal_replicas_are_published_once_by_the_lowest_rank():
    layout = plan([report(1, {"a": change("x")}), report(0, {"a": change("x")})])
    assert isinstance(layout, Layout)
    assert layout.owner == {"a": 0}
    assert [len(s) for s in layout.shards] == [1, 0]


def test_divergent_replicas_and_failed_ranks_name_the_ranks():
    divergent = plan([report(0, {"a": change("x")}), report(1, {"a": None})])
    assert isinstance(divergent, Failure) and divergent.kind == "publish"
    assert "'a'" in divergent.message and "[0, 1]" in divergent.message
    assert "weight_v000005" in divergent.message
    failed = plan([report(0, {}), DiffReport(1, "OSError: disk full", {}, False)])
    assert isinstance(failed, Failure) and "rank 1: OSError: disk full" in failed.message


@pytest.mark.parametrize(
    "stream, every, chain, full",
    [
        (STREAM, None, None, False),
        (StreamState("s", 4, 5, chain_deltas=2), 3, None, True),
        (StreamState("s", 4, 5, chain_deltas=1), 3, None, False),
        (StreamState("s", 4, 5, chain_wire=495), None, 0.5, True),  # 495 + 10 > 0.5 * 1000
        (StreamState("s", 4, 5, chain_wire=480), None, 0.5, False),
    ],
)
def test_anchor_rules(stream: StreamState, every: int | None, chain: float | None, full: bool):
    reports = [report(0, {"a": change("x", payload=10)})]
    config = PublisherConfig(anchor_every=every, anchor_chain_bytes=chain)
    got = wants_full(reports, stream, config, wire_estimate=10, total_bytes=1000)
    assert got is full
    assert wants_full(
        [report(0, {}, full=True)], STREAM, PublisherConfig(), wire_estimate=0, total_bytes=1000
    )


def test_full_layout_keeps_owners_then_holders_then_balances_and_bounds_shards():
    shards = assign_full(SIZES, owner={"d": 1}, holders={"a": 1}, world_size=2, max_shard_bytes=350)
    by_rank = [[job.names for job in jobs] for jobs in shards]
    # d (400) is rank 1's own; a was last held by rank 1; b and c go to the lighter rank 0.
    assert by_rank == [[("b",), ("c",)], [("a",), ("d",)]]
    names = [job.shard for jobs in shards for job in jobs]
    assert names == [f"model-{i:05d}-of-00004.safetensors" for i in range(1, 5)]


def test_delta_layout_with_one_writer():
    shards = assign_delta({"a": 0, "b": 0}, ["b", "a"], world_size=2)
    assert shards == ((ShardJob("model-00000-of-00001.safetensors", ("a", "b")),), ())


def test_written_versions_are_checked_for_completeness_and_sizes():
    layout = Layout(full=False, shards=((), ()), changed={"a": 5, "b": 7}, owner={})
    ok = [
        Written(0, None, {"a": Placement("s0", 8, 20, "da")}, wire=20),
        Written(1, None, {"b": Placement("s1", 8, 30, "db")}, wire=30),
    ]
    entries = check_written(layout, ok, SIZES, 5)
    assert set(entries) == {"a", "b"}
    with pytest.raises(PublishError, match=r"missing \['b'\]"):
        check_written(layout, ok[:1], SIZES, 5)
    with pytest.raises(PublishError, match="two ranks"):
        check_written(layout, [ok[0], ok[0]], SIZES, 5)
    full = Layout(full=True, shards=(), changed={}, owner={})
    placed = {n: Placement("m", 0, size, "d") for n, size in SIZES.items()}
    assert check_written(full, [Written(0, None, placed)], SIZES, 5) == placed
    placed["c"] = Placement("m", 0, 1, "d")
    with pytest.raises(PublishError, match="wrong sizes"):
        check_written(full, [Written(0, None, placed)], SIZES, 5)
    failure = written_failure([Written(1, "OSError: quota")], 5, "/run")
    assert failure is not None and "rank 1: OSError: quota" in failure.message


def test_index_of_a_delta_and_of_a_full_version():
    layout = Layout(full=False, shards=((),), changed={"a": 5}, owner={"a": 0})
    writes = [Written(0, None, {"a": Placement("delta-1", 8, 20, "da")}, wire=20)]
    totals = version_totals(layout, writes, STREAM, 1000, 5)
    assert (totals.changed_bytes, totals.wire_bytes, totals.base_version) == (5, 20, 4)
    index = build_index(
        "tok", layout, writes[0].entries, totals, STREAM, encoding="xor", checksum="xxh3-128"
    )
    assert (index.version, index.base_version, index.encoding, index.stream_id) == (
        5,
        4,
        "xor",
        "s1",
    )
    assert index.weight_map == {"a": "delta-1"} and index.commit_token == "tok"
    full = Layout(full=True, shards=((),), changed={}, owner={})
    full_totals = version_totals(full, writes, STREAM, 1000, 5)
    full_index = build_index(
        "tok", full, {}, full_totals, STREAM, encoding="xor", checksum="xxh3-128"
    )
    assert full_index.base_version is None and full_index.encoding is None


def test_stream_state_advances_only_through_committed():
    delta = Layout(full=False, shards=(), changed={}, owner={"a": 1})
    after_delta = STREAM.committed(delta, PublishResult(5, "delta", 4, 1, 5, 1000, 20))
    assert (after_delta.base_version, after_delta.next_version) == (5, 6)
    assert (after_delta.chain_deltas, after_delta.chain_wire, after_delta.holders) == (
        1,
        20,
        {"a": 1},
    )
    assert STREAM.chain_deltas == 0, "a value: the old state is unchanged"
    resumed = StreamState("s", 4, 5, walk_from_base=False, resumed=True, chain_deltas=3)
    full = Layout(full=True, shards=(), changed={}, owner={})
    after_full = resumed.committed(full, PublishResult(5, "full", None, 1, 5, 1000, 999))
    assert (after_full.chain_deltas, after_full.chain_wire) == (0, 0)
    assert after_full.walk_from_base and not after_full.resumed
