"""DeltaPublisher on a local store: what it commits, what it refuses, and when it advances.

The snapshot (the trainer's idea of what engines hold) must advance only once a version is
committed: a failed commit leaves it and the version counter where they were, so
the next publish reuses the number and still diffs against what engines really hold. A failed
post-write hook happens after the commit, so there the version stands and the snapshot moves.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import deltastore as ds
from deltastore.errors import (
    ConfigError,
    HookError,
    PublishError,
    SnapshotError,
    StreamError,
    VersionConflictError,
)
from deltastore.format.names import INDEX_NAME
from deltastore.publish import METRIC_KEYS, PublisherConfig
from deltastore.storage import VersionWriter, store_objects
from tests.conftest import HAVE_NUMBA, checkpoint_bytes, perturb, raw_bytes

Model = dict[str, torch.Tensor]


def _publisher(tmp_path: Path, base_dir: Path, **kwargs: Any) -> ds.DeltaPublisher:
    publisher = ds.DeltaPublisher(ds.VersionStore(tmp_path / "store"), base_dir, **kwargs)
    publisher.seed()
    return publisher


def _changed_bytes(old: Model, new: Model) -> int:
    return sum(
        int(
            np.count_nonzero(
                np.frombuffer(raw_bytes(old[n]), np.uint8)
                != np.frombuffer(raw_bytes(new[n]), np.uint8)
            )
        )
        for n in old
    )


def _pull_bytes(
    tmp_path: Path, store: ds.VersionStore, version: int, base_dir: Path
) -> dict[str, bytes]:
    host = tmp_path / f"check-host-{version}"
    ds.pull_weights(host, store, version, base_dir=base_dir)
    return checkpoint_bytes(host)


# ------------------------------------------------------------------ metrics
def test_metrics_exist_from_construction_and_are_cleared(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    publisher = ds.DeltaPublisher(str(tmp_path / "store"), base_dir)
    metrics = publisher.pop_metrics()
    assert set(metrics) == set(METRIC_KEYS)
    assert {"density", "changed_bytes", "total_bytes", "wire_bytes"} <= set(metrics)
    assert any(k.endswith("_s") for k in metrics)
    assert all(v == 0 for v in metrics.values())

    publisher.seed()
    new = perturb(small_model, 1)
    result = publisher.publish(new.items())
    metrics = publisher.pop_metrics()
    total = sum(len(raw_bytes(t)) for t in small_model.values())
    assert metrics["total_bytes"] == total == result.total_bytes
    assert metrics["changed_bytes"] == _changed_bytes(small_model, new) == result.changed_bytes > 0
    assert metrics["density"] == pytest.approx(metrics["changed_bytes"] / total)
    shard_sizes = sum(
        p.stat().st_size for p in (tmp_path / "store" / "weight_v000001").glob("*.safetensors")
    )
    assert metrics["wire_bytes"] == result.wire_bytes == shard_sizes
    assert metrics["publish_s"] > 0 and metrics["version"] == 1
    assert all(v == 0 for v in publisher.pop_metrics().values()), "pop_metrics clears"


# ------------------------------------------------------------ configuration
def test_unknown_codec_names_fail_at_construction(tmp_path: Path, base_dir: Path):
    with pytest.raises(ConfigError, match="overwrite"):
        ds.DeltaPublisher(str(tmp_path / "store"), base_dir, encoding="bsdiff")
    with pytest.raises(ConfigError, match="blake3"):
        ds.DeltaPublisher(str(tmp_path / "store"), base_dir, checksum="sha1")
    with pytest.raises(ConfigError, match="base checkpoint"):
        ds.DeltaPublisher(str(tmp_path / "store"), tmp_path / "missing")
    assert not (tmp_path / "store").exists() or ds.VersionStore(tmp_path / "store").versions() == []


def test_seed_publishes_nothing_and_publish_needs_seed(tmp_path: Path, base_dir: Path):
    publisher = ds.DeltaPublisher(str(tmp_path / "store"), base_dir)
    with pytest.raises(PublishError, match="seed"):
        publisher.publish([])
    publisher.seed()
    assert publisher.store.versions() == []


def test_seed_on_a_store_with_versions_needs_a_decision(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    _publisher(tmp_path, base_dir).publish(perturb(small_model, 1).items())
    restarted = ds.DeltaPublisher(str(tmp_path / "store"), base_dir)
    with pytest.raises(StreamError, match="weight_v000001"):
        restarted.seed()
    fresh = ds.DeltaPublisher(str(tmp_path / "store"), base_dir, new_stream=True)
    fresh.seed()
    result = fresh.publish(perturb(small_model, 2).items())
    assert result.version == 2, "a new stream continues the numbering, never restarts at v1"
    assert fresh.store.index(2).stream_id != fresh.store.index(1).stream_id


# ---------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "bad, match",
    [
        (("model.layers.9.unknown", torch.zeros(3)), "model.layers.9.unknown"),
        (
            ("model.layers.0.mlp.up_proj.weight", torch.zeros(24, 15)),
            "model.layers.0.mlp.up_proj.weight",
        ),
        (("model.layers.0.mlp.up_proj.weight", torch.zeros(24, 16, dtype=torch.int32)), "is I32"),
        (("model.layers.0.mlp.up_proj.weight", torch.zeros(16, 24)), "shape"),
        (("model.embed_tokens.weight", [1.0, 2.0]), "list"),
    ],
    ids=["unknown-name", "wrong-size", "wrong-dtype", "wrong-shape", "not-a-tensor"],
)
def test_bad_tensors_are_refused_by_name_and_nothing_moves(
    tmp_path: Path, base_dir: Path, small_model: Model, bad, match: str
):
    publisher = _publisher(tmp_path, base_dir)
    new = perturb(small_model, 1)
    # A good, changed tensor first: it must not leak into the snapshot when the call fails.
    good = [(n, t) for n, t in new.items() if raw_bytes(t) != raw_bytes(small_model[n])]
    with pytest.raises(PublishError, match=match):
        publisher.publish([*good, bad])
    assert publisher.store.versions() == []
    result = publisher.publish(new.items())
    assert result.version == 1
    assert result.changed_bytes == _changed_bytes(small_model, new)
    assert _pull_bytes(tmp_path, publisher.store, 1, base_dir) == {
        n: raw_bytes(t) for n, t in new.items()
    }


def test_a_model_in_another_precision_than_its_base_gets_the_cast_hint(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    """The README's sketch on an fp32 model whose base is bf16: the size differs too, but the
    dtype is what the user got wrong, and the message says how to cast."""
    publisher = _publisher(tmp_path, base_dir)
    name = "model.embed_tokens.weight"  # BF16 in the base
    fp32 = torch.nn.Parameter(small_model[name].float())
    with pytest.raises(PublishError, match=r"is F32, the base stores it as BF16") as caught:
        publisher.publish([(name, fp32)])
    assert "tensor.to(torch.bfloat16)" in str(caught.value)
    assert "equal sizes" not in str(caught.value)
    result = publisher.publish([(name, fp32.to(torch.bfloat16))])  # the README's cast
    assert result.version == 1


def test_a_tensor_passed_twice_is_refused(tmp_path: Path, base_dir: Path, small_model: Model):
    publisher = _publisher(tmp_path, base_dir)
    name = "model.norm.eps"
    with pytest.raises(PublishError, match=name):
        publisher.publish([(name, small_model[name]), (name, small_model[name])])


def test_committing_an_existing_version_conflicts(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    store = ds.VersionStore(tmp_path / "store")
    first = ds.DeltaPublisher(store, base_dir)
    second = ds.DeltaPublisher(ds.VersionStore(tmp_path / "store"), base_dir)
    first.seed()
    second.seed()
    first.publish(perturb(small_model, 1).items())
    index_bytes = (tmp_path / "store" / "weight_v000001" / INDEX_NAME).read_bytes()
    with pytest.raises(VersionConflictError, match="weight_v000001"):
        second.publish(perturb(small_model, 2).items())
    assert (tmp_path / "store" / "weight_v000001" / INDEX_NAME).read_bytes() == index_bytes
    # Directly: a second commit of a committed version with another token conflicts...
    index = store.index(1)
    with pytest.raises(VersionConflictError):
        VersionWriter(store_objects(store), 1, "someone-else").commit(index)
    # ...while the same token (the writer's own commit, acknowledgement lost) stands.
    assert index.commit_token is not None
    VersionWriter(store_objects(store), 1, index.commit_token).commit(index)
    assert store.versions() == [1]


# ------------------------------------------------------------ what it writes
def test_inputs_of_any_layout_and_type(tmp_path: Path, base_dir: Path, small_model: Model):
    """Non-contiguous torch views, numpy arrays and raw uint8 bytes publish the same bytes."""
    publisher = _publisher(tmp_path, base_dir)
    new = perturb(small_model, 2)
    up = "model.layers.0.mlp.up_proj.weight"
    embed = "model.embed_tokens.weight"
    new[up] = new[up] + 1
    new[embed] = new[embed] * 2
    inputs: list[tuple[str, Any]] = []
    for name, t in new.items():
        if name == up:
            inputs.append((name, t.t().contiguous().t()))  # a transposed (non-contiguous) view
            assert not inputs[-1][1].is_contiguous()
        elif name == "model.layers.0.self_attn.q_proj.weight":
            inputs.append((name, t.numpy()))
        elif name == embed:
            inputs.append((name, np.frombuffer(raw_bytes(t), np.uint8)))  # dtype-blind bytes
        else:
            inputs.append((name, t))
    result = publisher.publish(inputs)
    assert result.changed_bytes == _changed_bytes(small_model, new)
    assert _pull_bytes(tmp_path, publisher.store, 1, base_dir) == {
        n: raw_bytes(t) for n, t in new.items()
    }


def test_empty_step_and_full_version(tmp_path: Path, base_dir: Path, small_model: Model):
    publisher = _publisher(tmp_path, base_dir, encoding="overwrite", checksum="adler32")
    store = publisher.store
    empty = publisher.publish(small_model.items())
    assert (empty.version, empty.kind, empty.tensors_changed, empty.wire_bytes) == (
        1,
        "delta",
        0,
        0,
    )
    assert store.index(1).weight_map == {} and store.index(1).base_version == 0
    none_passed = publisher.publish([])
    assert none_passed.version == 2 and store.index(2).weight_map == {}

    new = perturb(small_model, 3)
    full = publisher.publish([next(iter(new.items()))], full=True)
    index = store.index(3)
    assert (full.kind, index.kind, index.base_version, index.encoding) == (
        "full",
        "full",
        None,
        None,
    )
    assert set(index.weight_map) == set(small_model), "a full version holds every tensor"
    assert index.checksum == "adler32"
    after = publisher.publish(new.items())
    assert after.version == 4 and store.index(4).base_version == 3
    assert _pull_bytes(tmp_path, store, 4, base_dir) == {n: raw_bytes(t) for n, t in new.items()}


def test_post_write_hook_gets_the_reference_arguments(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    calls: list[tuple[Any, str, Any]] = []

    def hook(args: Any, version_dir: str, rollout_engines: Any) -> None:
        assert os.path.exists(os.path.join(version_dir, INDEX_NAME))
        calls.append((args, version_dir, rollout_engines))

    args, engines = object(), ["engine-0"]
    publisher = ds.DeltaPublisher(
        str(tmp_path / "store"), base_dir, post_write=hook, args=args, rollout_engines=engines
    )
    publisher.seed()
    publisher.publish(perturb(small_model, 1).items())
    assert calls == [(args, store_objects(publisher.store).version_url(1), engines)]


# ------------------------------------------------- snapshot advances only on success
def test_failing_post_write_hook_commits_and_advances(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    failures = [RuntimeError("mount refused the upload")]

    def hook(args: Any, version_dir: str, rollout_engines: Any) -> None:
        if failures:
            raise failures.pop()

    store = ds.VersionStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir, post_write=hook)
    assert store.post_write is None, "the caller's store is not modified"
    publisher.seed()
    v1 = perturb(small_model, 1)
    with pytest.raises(HookError, match="weight_v000001") as info:
        publisher.publish(v1.items())
    assert "mount refused the upload" in str(info.value)
    assert publisher.store.versions() == [1]
    assert publisher.pop_metrics()["version"] == 1
    v2 = perturb(v1, 2)
    result = publisher.publish(v2.items())
    assert (result.version, result.base_version) == (2, 1)
    assert result.changed_bytes == _changed_bytes(v1, v2), "the snapshot advanced to v1"
    assert _pull_bytes(tmp_path, publisher.store, 2, base_dir) == {
        n: raw_bytes(t) for n, t in v2.items()
    }


class FlakyCommitStore(ds.VersionStore):
    """A store whose next ``fail`` index writes raise, as a lost connection would; with
    ``land=True`` the index lands before the error (a lost acknowledgement)."""

    fail = 0
    land = False
    blind = False
    """Reads of the version listing fail (the store cannot tell what landed)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        objects = store_objects(self)
        create_or_read = objects.create_or_read

        def flaky(path: str, data: bytes) -> bytes | None:
            if self.fail and path.endswith(INDEX_NAME):
                self.fail -= 1
                if self.land:
                    create_or_read(path, data)
                raise OSError("connection reset while writing the index")
            return create_or_read(path, data)

        objects.create_or_read = flaky  # type: ignore[method-assign]

    def refresh(self, version: int | None = None) -> None:
        if self.blind:
            raise OSError("connection reset while listing")
        super().refresh(version)


def test_commit_whose_outcome_is_unknown_is_not_a_publish_error(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    """The index landed but the store cannot say so: the error must not promise that nothing
    was committed (a PublishError would), and the stream restarts from the store."""
    store = FlakyCommitStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir)
    publisher.seed()
    store.fail, store.land, store.blind = 1, True, True
    with pytest.raises(SnapshotError, match="weight_v000001") as info:
        publisher.publish(perturb(small_model, 1).items())
    assert not isinstance(info.value, PublishError)
    assert "resume=True" in str(info.value)
    store.blind = False
    assert store.versions() == [1], "the index did land"
    with pytest.raises(PublishError, match="seed"):
        publisher.publish(perturb(small_model, 2).items())


def test_commit_with_a_lost_acknowledgement_stands(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    store = FlakyCommitStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir)
    publisher.seed()
    store.fail, store.land = 1, True
    v1 = perturb(small_model, 1)
    assert publisher.publish(v1.items()).version == 1
    v2 = perturb(v1, 2)
    result = publisher.publish(v2.items())
    assert (result.version, result.base_version) == (2, 1)
    assert result.changed_bytes == _changed_bytes(v1, v2), "the snapshot advanced to v1"


@pytest.mark.parametrize("full", [False, True])
def test_failed_commit_does_not_advance(
    tmp_path: Path, base_dir: Path, small_model: Model, full: bool
):
    store = FlakyCommitStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir, encoding="xor")
    publisher.seed()
    v1 = perturb(small_model, 1)
    store.fail = 1
    with pytest.raises(PublishError, match="weight_v000001") as info:
        publisher.publish(v1.items(), full=full)
    assert "connection reset" in str(info.value)
    assert store.versions() == []
    assert not (tmp_path / "store" / "weight_v000001").exists(), "the aborted files are removed"
    assert all(v == 0 for v in publisher.pop_metrics().values())

    # The same number is reused and the diff is still against the base (nothing advanced).
    v1b = perturb(v1, 5)
    result = publisher.publish(v1b.items())
    assert (result.version, result.base_version) == (1, 0)
    assert result.changed_bytes == _changed_bytes(small_model, v1b)
    assert _pull_bytes(tmp_path, store, 1, base_dir) == {n: raw_bytes(t) for n, t in v1b.items()}


def _fail_collective(publisher: ds.DeltaPublisher, kind: str, step: str) -> None:
    """Make the ``kind`` collective named ``step`` fail once, as a peer dying in it does."""
    coordinator = publisher.coordinator
    collective = getattr(coordinator, kind)

    def failing(obj: Any, *, what: str) -> Any:
        if what == step:
            delattr(coordinator, kind)  # once
            raise PublishError(f"rank 0: the collective step '{what}' failed")
        return collective(obj, what=what)

    setattr(coordinator, kind, failing)


@pytest.mark.parametrize(
    ("kind", "step"), [("broadcast", "publish: plan"), ("gather", "publish: commit weight_v000001")]
)
def test_a_collective_failing_before_the_commit_leaves_no_claim(
    tmp_path: Path, base_dir: Path, small_model: Model, kind: str, step: str
):
    """Rank 0 claimed the version, then a collective failed: nothing was committed, and the
    claim and files are removed, so the next publish claims the same number again."""
    publisher = _publisher(tmp_path, base_dir)
    _fail_collective(publisher, kind, step)
    with pytest.raises(PublishError, match=step):
        publisher.publish(perturb(small_model, 1).items())
    assert publisher.store.versions() == []
    assert not (tmp_path / "store" / "weight_v000001").exists()
    v1 = perturb(small_model, 2)
    assert publisher.publish(v1.items()).version == 1
    assert _pull_bytes(tmp_path, publisher.store, 1, base_dir) == {
        n: raw_bytes(t) for n, t in v1.items()
    }


def test_a_collective_failing_after_the_commit_stops_the_publisher(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    """The outcome's broadcast failed: the version may be committed, so the publisher keeps
    no snapshot (a later publish would diff against a state engines may not hold)."""
    publisher = _publisher(tmp_path, base_dir)
    _fail_collective(publisher, "broadcast", "publish: commit weight_v000001")
    with pytest.raises(SnapshotError, match="may be committed"):
        publisher.publish(perturb(small_model, 1).items())
    assert publisher.snapshot is None
    with pytest.raises(PublishError, match="seed"):
        publisher.publish(perturb(small_model, 2).items())


# ------------------------------------------------------------------ API edges
def test_a_state_dict_mapping_is_accepted_like_pairs(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    publisher = _publisher(tmp_path, base_dir)
    new = perturb(small_model, 1)
    result = publisher.publish(new)  # a Mapping name -> tensor, as model.state_dict() is
    assert result.version == 1
    assert result.changed_bytes == _changed_bytes(small_model, new)
    assert _pull_bytes(tmp_path, publisher.store, 1, base_dir) == {
        n: raw_bytes(t) for n, t in new.items()
    }
    with pytest.raises(PublishError, match=r"mapping name -> tensor or \(name, tensor\) pairs"):
        publisher.publish(list(new))  # names only


def test_a_dense_version_warns_once_and_says_why(
    tmp_path: Path, base_dir: Path, small_model: Model, caplog: pytest.LogCaptureFixture
):
    publisher = _publisher(tmp_path, base_dir)
    v1 = perturb(small_model, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert publisher.publish(v1.items()).density < 0.2, "an RL-like step does not warn"
    dense = {
        n: (t.reshape(-1).view(torch.uint8) ^ 0xFF).view(t.dtype).reshape(t.shape)
        for n, t in v1.items()
    }
    with pytest.warns(RuntimeWarning, match="bf16") as record:
        result = publisher.publish(dense.items())
    assert result.density > 0.9 and len(record) == 1
    assert "weight_v000002" in caplog.text and "bf16" in caplog.text
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        publisher.publish(v1.items())  # dense again: warned once per publisher


def test_a_collective_without_torch_distributed_is_a_config_error(tmp_path: Path, base_dir: Path):
    with pytest.raises(ConfigError, match="not initialised"):
        ds.DeltaPublisher(str(tmp_path / "store"), base_dir, collective=True)
    with pytest.raises(ConfigError, match="not initialised"):
        ds.DeltaPublisher(str(tmp_path / "store"), base_dir, process_group=object())


def test_settings_come_as_keywords_or_one_config(tmp_path: Path, base_dir: Path):
    config = PublisherConfig(encoding="overwrite", anchor_every=3)
    publisher = ds.DeltaPublisher(str(tmp_path / "store"), base_dir, config, workers=1)
    assert publisher.config == PublisherConfig(encoding="overwrite", anchor_every=3, workers=1)
    with pytest.raises(ConfigError, match="anchor_evry"):
        ds.DeltaPublisher(str(tmp_path / "store"), base_dir, anchor_evry=3)
    with pytest.raises(ConfigError, match="anchor_every"):
        PublisherConfig(anchor_every=0)


def test_a_failed_delta_commit_on_a_published_base_is_retried_as_the_next_version(
    tmp_path: Path, base_dir: Path, small_model: Model
):
    """A delta on v1 whose index write fails after it took v1's one successor leaves v2 fenced
    (a tombstone): the retry skips it instead of conflicting until a restart."""
    store = FlakyCommitStore(tmp_path / "store")
    publisher = ds.DeltaPublisher(store, base_dir)
    publisher.seed()
    v1 = perturb(small_model, 1)
    publisher.publish(v1.items())
    store.fail = 1
    with pytest.raises(PublishError, match="weight_v000002"):
        publisher.publish(perturb(v1, 2).items())
    v2 = perturb(v1, 3)
    result = publisher.publish(v2.items())
    assert result.version in (2, 3) and result.base_version == 1
    assert result.changed_bytes == _changed_bytes(v1, v2)
    assert _pull_bytes(tmp_path, store, result.version, base_dir) == {
        n: raw_bytes(t) for n, t in v2.items()
    }


SEED_AND_LIST_KERNELS = """
import sys, torch
from safetensors.torch import save_file
import deltastore as ds
encoding, base, store = sys.argv[1:]
save_file({"w": torch.zeros(4096, dtype=torch.bfloat16)}, base + "/model.safetensors")
ds.DeltaPublisher(store, base, encoding=encoding).seed()
kernels = sys.modules.get("deltastore.codecs.numba_backend")
print(0 if kernels is None else len(kernels._xor_at.signatures))
print(0 if kernels is None else len(kernels._encode_batch.signatures))
"""


@pytest.mark.skipif(not HAVE_NUMBA, reason="no numba")
@pytest.mark.parametrize("encoding", ["xor", "overwrite", "auto"])
def test_seed_loads_the_compiled_kernels_a_first_publish_would(
    encoding: str, tmp_path: Path
) -> None:
    """In a fresh process, ``seed()`` loads the compiled XOR of the snapshot's advance (every
    encoding uses it) for each element size, and deltastore's own encoders only for its own
    encodings: the first publish of a process no longer pays for numba's import (it did for
    the reference encodings, whose seed loaded nothing)."""
    out = subprocess.run(
        [sys.executable, "-c", SEED_AND_LIST_KERNELS, encoding, str(tmp_path), str(tmp_path / "s")],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "DELTASTORE_NO_JIT": "0"},
    )
    xor_kernels, encoders = (int(line) for line in out.stdout.split())
    assert xor_kernels == 4  # one per element size: 1, 2, 4, 8 bytes
    assert (encoders > 0) == (encoding == "auto")
