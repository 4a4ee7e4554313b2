"""Every code block of README.md and docs/*.md that can run locally runs here, and the example
script runs, so an example cannot rot.

A fenced block tagged ``python``, ``bash`` or ``sh`` runs unless its info string says
``skip: <why>`` (e.g. ```` ```bash skip: needs an S3 bucket ````). Bash blocks run with
``set -euo pipefail`` in a fresh temp directory, with ``deltastore`` on PATH running this
checkout; python blocks run as a script there. The docs also never point outside the repository.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
RUNNABLE = {"python", "bash", "sh"}
FENCE = re.compile(r"^```(\S*)(.*)$")

# Files whose blocks are not yet marked runnable-or-skip: owned by work in flight, which marks
# them; drop an entry here once it has. Their blocks are not run.
NOT_YET_MARKED: set[str] = set()
# Pointers to design notes outside the repository; a doc must say it in its own words.
OUTSIDE_REFERENCES = re.compile(r"shared/design|TRAPS|OBJECT_STORES|REFERENCE_FORMAT")
NOT_YET_REWORDED: set[str] = set()


@dataclass(frozen=True)
class Block:
    file: str
    line: int
    language: str
    code: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}"


def blocks(path: Path) -> list[Block]:
    """The runnable fenced blocks of one markdown file (not marked ``skip``)."""
    rel = str(path.relative_to(ROOT))
    found: list[Block] = []
    lines = path.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match or not match.group(1):
            i += 1
            continue
        start, language, info = i + 1, match.group(1), match.group(2)
        i += 1
        body = []
        while i < len(lines) and lines[i] != "```":
            body.append(lines[i])
            i += 1
        i += 1
        if language in RUNNABLE and "skip" not in info and rel not in NOT_YET_MARKED:
            found.append(Block(rel, start, language, "\n".join(body) + "\n"))
    return found


ALL_BLOCKS = [block for path in DOCS for block in blocks(path)]


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """An environment where ``deltastore`` and ``python`` run this checkout."""
    bindir = tmp_path_factory.mktemp("bin")
    script = bindir / "deltastore"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m deltastore.cli "$@"\n')
    script.chmod(0o755)
    # A script, not a symlink: a venv's interpreter reached through a link elsewhere does not
    # find its pyvenv.cfg, so it would run without the venv's packages.
    python = bindir / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    return {
        **os.environ,
        "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "DELTASTORE_REPO": str(ROOT),
        "COLUMNS": "120",
    }


def test_some_blocks_run() -> None:
    """Guard against a parser that silently finds nothing."""
    assert len(ALL_BLOCKS) >= 2, ALL_BLOCKS


@pytest.mark.timeout(120)
@pytest.mark.parametrize("block", ALL_BLOCKS, ids=str)
def test_doc_block_runs(block: Block, shim: dict[str, str], tmp_path: Path) -> None:
    if block.language == "python":
        command = [sys.executable, "-c", block.code]
    else:
        command = ["bash", "-c", "set -euo pipefail\n" + block.code]
    proc = subprocess.run(
        command, cwd=tmp_path, env=shim, capture_output=True, text=True, timeout=110
    )
    assert proc.returncode == 0, f"{block} failed:\n{block.code}\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.timeout(120)
def test_example_script_runs(tmp_path: Path, shim: dict[str, str]) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_publish_pull.py"), str(tmp_path)],
        env=shim,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("both hosts verified") == 3
    assert "versions [1, 2, 3]" in proc.stdout
    for host in ("host0", "host1"):
        assert (tmp_path / host / "model.safetensors").exists()


def test_docs_stand_alone() -> None:
    """No doc, module or test points at design notes outside the repository."""
    offenders = []
    for pattern in ("README.md", "docs/*.md", "deltastore/**/*.py", "tests/**/*.py"):
        for path in ROOT.glob(pattern):
            rel = str(path.relative_to(ROOT))
            if rel in NOT_YET_REWORDED or path == Path(__file__):
                continue
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                if OUTSIDE_REFERENCES.search(line):
                    offenders.append(f"{rel}:{number}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
