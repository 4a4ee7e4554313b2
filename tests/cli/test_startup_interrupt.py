"""A Ctrl-C while the command starts up (building the parser imports every subcommand) ends
the command like one later on: exit 130, one line, no traceback."""

from __future__ import annotations

import pytest

import deltastore.cli as cli


def test_ctrl_c_while_the_parser_is_built_exits_130_without_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def interrupted() -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "build_parser", interrupted)
    assert cli.main(["ls", "/nowhere"]) == cli.EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert err.strip() == "deltastore: interrupted"
