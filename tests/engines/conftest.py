"""Fixtures of the LiveWeights tests: a real training run and an engine kept current."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest

from tests.engines.helpers import TrainingRun


@pytest.fixture(autouse=True)
def _quiet_density_warning() -> None:
    # A tiny model's AdamW step changes a large share of its bf16 elements; the publisher warns.
    warnings.filterwarnings("ignore", message=".*changed .* of the model's bytes")


@pytest.fixture
def run(tmp_path: Path) -> TrainingRun:
    """A training run with version 0 seeded (encoding ``auto``), nothing published yet."""
    return TrainingRun.start(tmp_path, encoding="auto")
