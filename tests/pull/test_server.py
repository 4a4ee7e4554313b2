"""``deltastore serve`` over real HTTP: the reference request and reply, auth, allowed roots,
per-dir serialisation, ``/state``, ``/healthz``, and the ``pull_all`` client."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deltastore import FormatError, StoreError, verify_local
from deltastore.pull import PullReply, PullRequest, fetch_state, pull_all
from tests.pull.helpers import Published, many_tensors, publish_versions, write_checkpoint

TOKEN = "s3cret-token"


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[str]


def start_server(*args: str) -> Server:
    proc = subprocess.Popen(
        [sys.executable, "-m", "deltastore.cli", "serve", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if "listening on" not in line:
        proc.kill()
        raise AssertionError(f"server did not start: {line!r} {proc.communicate()[1]}")
    return Server(line.rsplit(" ", 1)[-1].strip(), proc)


def stop_server(server: Server) -> None:
    server.proc.terminate()
    server.proc.communicate(timeout=30)


def http(
    method: str, url: str, body: dict[str, object] | None = None, token: str | None = TOKEN
) -> tuple[int, dict[str, object]]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Published, Path, Server]]:
    """A store with 4 versions under an allowed root, and a server with a token."""
    root = tmp_path_factory.mktemp("serve")
    allowed = root / "allowed"
    base = many_tensors(30, seed=111, elements=512)
    write_checkpoint(root / "base", base)
    published = publish_versions(allowed / "store", root / "base", base, 4, seed=112)
    (root / "token").write_text(TOKEN + "\n")
    server = start_server(
        "--base", str(root / "base"), "--allow", str(allowed), "--token-file", str(root / "token")
    )
    yield published, allowed, server
    stop_server(server)


def pull_body(local: Path, published: Published, version: int) -> dict[str, object]:
    return {
        "local_checkpoint_dir": str(local),
        "source_dir": str(published.store_dir),
        "target_version": version,
    }


def test_healthz_and_auth(world):
    published, allowed, server = world
    assert http("GET", f"{server.url}/healthz", token=None)[0] == 200
    body = pull_body(allowed / "h-auth", published, 1)
    for token in (None, "wrong"):
        status, reply = http("POST", f"{server.url}/pull_weights", body, token=token)
        assert status == 401 and reply["success"] is False and "token" in str(reply["message"])
        status, _ = http("GET", f"{server.url}/state?local_checkpoint_dir=/x", token=token)
        assert status == 401
    assert not (allowed / "h-auth").exists()


def test_paths_outside_the_allowed_roots_are_refused(world, tmp_path: Path):
    published, allowed, server = world
    outside = tmp_path / "elsewhere"
    status, reply = http("POST", f"{server.url}/pull_weights", pull_body(outside, published, 1))
    assert status == 403 and reply["success"] is False and "allowed" in str(reply["message"])
    assert not outside.exists()
    body = pull_body(allowed / "h-src", published, 1) | {"source_dir": str(tmp_path)}
    assert http("POST", f"{server.url}/pull_weights", body)[0] == 403
    sneaky = pull_body(allowed / ".." / "escape", published, 1)
    assert http("POST", f"{server.url}/pull_weights", sneaky)[0] == 403
    status, _ = http("GET", f"{server.url}/state?local_checkpoint_dir={outside}")
    assert status == 403


def test_latest_pulls_the_newest_version(world):
    published, allowed, server = world
    local = allowed / "h-latest"
    body = pull_body(local, published, 1) | {"target_version": "latest"}
    status, reply = http("POST", f"{server.url}/pull_weights", body)
    assert status == 200 and reply["success"] is True, reply
    status, state = http("GET", f"{server.url}/state?local_checkpoint_dir={local}")
    assert status == 200 and state["version"] == max(published.states)


def test_bad_requests_are_400(world):
    published, allowed, server = world
    good = pull_body(allowed / "h-bad", published, 1)
    for bad in (
        {k: v for k, v in good.items() if k != "source_dir"},
        good | {"target_version": -1},
        good | {"target_version": "newest"},
        good | {"target_version": "\u00b2"},  # str.isdigit() is true, int() raises
        good | {"target_version": 1.5},
        good | {"local_checkpoint_dir": "relative/dir"},
    ):
        status, reply = http("POST", f"{server.url}/pull_weights", bad)
        assert status == 400 and reply["success"] is False and reply["message"]
    status, reply = http("POST", f"{server.url}/pull_weights", good | {"target_versoin": 1})
    assert status == 400 and "unknown field 'target_versoin'" in str(reply["message"])
    assert not (allowed / "h-bad").exists()
    nested = b"[" * 30_000 + b"]" * 30_000  # deeper than json's recursion limit, < 64 KiB
    request = urllib.request.Request(
        f"{server.url}/pull_weights",
        data=nested,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
        method="POST",
    )
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(request, timeout=60)
    assert caught.value.code == 400 and json.loads(caught.value.read())["success"] is False


def test_pull_state_and_a_failed_pull(world):
    published, allowed, server = world
    local = allowed / "h1"
    status, reply = http("POST", f"{server.url}/pull_weights", pull_body(local, published, 2))
    assert (status, reply["success"]) == (200, True), reply
    assert verify_local(local, published.store_dir, 2, published.base_dir) == 2

    status, state = http("GET", f"{server.url}/state?local_checkpoint_dir={local}")
    assert status == 200 and state["version"] == 2 and state["pending"] is None
    assert state["stream_id"] == published.stream_id
    assert fetch_state(server.url, str(local), token=TOKEN).version == 2

    status, reply = http("POST", f"{server.url}/pull_weights", pull_body(local, published, 99))
    assert status == 400 and reply["success"] is False and "weight_v000099" in str(reply["message"])
    assert fetch_state(server.url, str(local), token=TOKEN).version == 2


def test_requests_for_one_dir_are_serialised(world):
    published, allowed, server = world
    local = allowed / "h-concurrent"
    body = pull_body(local, published, 4)
    with cf.ThreadPoolExecutor(3) as pool:
        replies = list(
            pool.map(lambda _: http("POST", f"{server.url}/pull_weights", body), range(3))
        )
    assert all(status == 200 and reply["success"] for status, reply in replies), replies
    messages = [str(reply["message"]) for _, reply in replies]
    assert sum("already at v000004" in m for m in messages) == 2, messages


def test_pull_all_fans_out_to_every_host(world, tmp_path: Path):
    published, allowed, server = world
    second = start_server("--base", str(published.base_dir), "--allow", str(allowed))
    try:
        dead = "http://127.0.0.1:9"  # discard port: nothing listens
        dirs = {
            server.url: str(allowed / "fan-a"),
            second.url: str(allowed / "fan-b"),
            dead: str(allowed / "fan-c"),
        }
        replies = pull_all(
            [server.url, second.url, dead],
            3,
            local_checkpoint_dir=dirs,
            source_dir=str(published.store_dir),
            token=TOKEN,
            timeout_s=60,
        )
    finally:
        stop_server(second)
    assert [r.endpoint for r in replies] == [server.url, second.url, dead]
    assert replies[0].success and replies[1].success, [r.describe() for r in replies]
    assert not replies[2].success and replies[2].status is None
    assert "unreachable" in replies[2].reply.message
    for directory in (dirs[server.url], dirs[second.url]):
        assert verify_local(directory, published.store_dir, 3, published.base_dir) == 3


def test_local_dir_inside_the_base_is_refused(tmp_path: Path):
    base = many_tensors(4, seed=113, elements=64)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(tmp_path / "store", tmp_path / "base", base, 1, seed=114)
    server = start_server("--base", str(tmp_path / "base"))  # loopback, no --allow: any path
    try:
        for local in (tmp_path / "base", tmp_path / "base" / "sub", tmp_path):
            status, reply = http(
                "POST", f"{server.url}/pull_weights", pull_body(local, published, 1), token=None
            )
            assert status == 403 and "base" in str(reply["message"])
        status, reply = http(
            "POST", f"{server.url}/pull_weights", pull_body(tmp_path / "h", published, 1), None
        )
        assert status == 200 and reply["success"] is True
    finally:
        stop_server(server)


def test_refuses_a_non_loopback_host_without_allow(tmp_path: Path):
    write_checkpoint(tmp_path / "base", many_tensors(2, seed=115, elements=8))
    command = [sys.executable, "-m", "deltastore.cli", "serve", "--base", str(tmp_path / "base")]
    proc = subprocess.run(
        [*command, "--port", "0", "--host", "0.0.0.0"],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=os.getcwd()),
    )
    assert proc.returncode != 0
    assert "--allow" in proc.stderr and "listening" not in proc.stdout


def test_reply_type_is_strict():
    """One typed reply for every caller: other key names are an error, not 'unknown'."""
    assert PullReply.from_json(b'{"success": false, "message": "x"}') == PullReply(False, "x")
    with pytest.raises(FormatError, match="success"):
        PullReply.from_json(b'{"ok": false, "error": "disk full"}')
    with pytest.raises(FormatError):
        PullRequest.from_json(b'{"local_checkpoint_dir": "/a", "target_version": 1}')
    assert PullRequest.from_json(
        b'{"local_checkpoint_dir": "/a", "source_dir": "s3://b/r", "target_version": "000007"}'
    ) == PullRequest("/a", "s3://b/r", 7)


def test_server_answers_while_a_pull_runs(tmp_path: Path):
    base = many_tensors(4, seed=116, elements=64)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(tmp_path / "store", tmp_path / "base", base, 1, seed=117)
    server = start_server(
        "--base", str(tmp_path / "base"), "--pre-read-hook", "tests.pull.slow_hook.hold"
    )
    local = tmp_path / "h"
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                http, "POST", f"{server.url}/pull_weights", pull_body(local, published, 1), None
            )
            seen_busy = False
            while not pending.done():
                status, health = http("GET", f"{server.url}/healthz", token=None)
                assert status == 200
                _, state = http("GET", f"{server.url}/state?local_checkpoint_dir={local}", None)
                if health["pulls_running"] == 1 and state["busy"] and not pending.done():
                    seen_busy = True
            status, reply = pending.result()
    finally:
        stop_server(server)
    assert seen_busy, "the server never answered while the pull was running"
    assert status == 200 and reply["success"] is True


def test_pull_all_reports_a_host_that_does_not_speak_http():
    """A host answering garbage (not HTTP) or hanging up mid-reply is one failed reply; the
    other hosts' outcomes are still returned."""
    import socket
    import threading

    def garbage_server(reply: bytes) -> tuple[socket.socket, str]:
        listener = socket.socket()
        listener.bind(("127.0.0.1", 0))
        listener.listen()

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

        threading.Thread(target=answer, daemon=True).start()
        return listener, f"http://127.0.0.1:{listener.getsockname()[1]}"

    not_http, url_a = garbage_server(b"SSH-2.0-OpenSSH_9.6\r\n")
    cut_short, url_b = garbage_server(
        b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 500\r\n\r\n{"succ'
    )
    try:
        replies = pull_all(
            [url_a, url_b],
            1,
            local_checkpoint_dir="/nonexistent",
            source_dir="/nonexistent",
            timeout_s=30,
        )
    finally:
        not_http.close()
        cut_short.close()
    assert [r.endpoint for r in replies] == [url_a, url_b]
    assert not any(r.success for r in replies), [r.describe() for r in replies]
    assert all(url in r.describe() for url, r in zip([url_a, url_b], replies))
    still_not_http, url_c = garbage_server(b"SSH-2.0-OpenSSH_9.6\r\n")
    try:
        with pytest.raises(StoreError, match="unreachable"):
            fetch_state(url_c, "/nonexistent", timeout_s=30)
    finally:
        still_not_http.close()


def test_a_list_of_sources_is_read_nearest_first_and_each_is_checked(world, tmp_path: Path):
    published, allowed, server = world
    local = allowed / "h-near"
    near = str(allowed / "no-replica-yet")
    body = pull_body(local, published, 2) | {"source_dir": [near, str(published.store_dir)]}
    status, reply = http("POST", f"{server.url}/pull_weights", body)
    assert (status, reply["success"]) == (200, True), reply
    assert verify_local(local, published.store_dir, 2, published.base_dir) == 2
    # serve replies before the flush and the state; its /state waits for them (reading the
    # file at once raced the server's completion under load)
    status, recorded = http("GET", f"{server.url}/state?local_checkpoint_dir={local}")
    assert status == 200 and recorded["version"] == 2, recorded
    state = json.loads((local / ".weight_sync" / "state.json").read_text())
    assert set(state["sources"].values()) == {str(published.store_dir)}
    outside = body | {"source_dir": [str(published.store_dir), str(tmp_path)]}
    assert http("POST", f"{server.url}/pull_weights", outside)[0] == 403
    for bad in ([], [""], [1], ["a"] * 9):
        status, reply = http("POST", f"{server.url}/pull_weights", body | {"source_dir": bad})
        assert status == 400 and "source_dir" in str(reply["message"]), reply


def test_serve_replies_once_verified_and_the_flush_and_state_follow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """A catch-up through ``serve`` (in this process, msync held): the reply comes with the
    new bytes verified in the files and no state naming either version yet; ``/state`` still
    answers (off the event loop, once the flush is done) and then names the target."""
    import asyncio
    import threading

    import deltastore.pull.local as pull_local
    from deltastore.pull import wait_durable
    from deltastore.pull.server import ServerConfig, serve_async

    base = many_tensors(8, seed=120, elements=4096)
    write_checkpoint(tmp_path / "base", base)
    published = publish_versions(tmp_path / "store", tmp_path / "base", base, 2, seed=121)
    gate, held = threading.Event(), threading.Event()
    real_msync = pull_local.msync

    def gated_msync(*args: object, **kwargs: object) -> object:
        held.set()
        assert gate.wait(60)
        return real_msync(*args, **kwargs)

    urls: list[str] = []
    stop = asyncio.Event()
    loop = asyncio.new_event_loop()
    config = ServerConfig(base_dir=str(tmp_path / "base"), port=0)
    thread = threading.Thread(
        target=lambda: loop.run_until_complete(serve_async(config, urls.append, stop))
    )
    thread.start()
    try:
        while not urls:
            threading.Event().wait(0.01)
        local = tmp_path / "h"
        status, reply = http("POST", f"{urls[0]}/pull_weights", pull_body(local, published, 1))
        assert status == 200 and reply["success"] is True, reply
        wait_durable(local)  # v1's own flush, which may still run after its reply, ungated
        monkeypatch.setattr(pull_local, "msync", gated_msync)
        status, reply = http("POST", f"{urls[0]}/pull_weights", pull_body(local, published, 2))
        assert status == 200 and reply["success"] is True, reply
        # The reply is in while the flush cannot finish (it may start just after the reply).
        assert held.wait(30), "no flush followed the reply"
        sync = local / ".weight_sync"
        assert (sync / "pending.json").exists() and not (sync / "state.json").exists()
        with cf.ThreadPoolExecutor(1) as pool:
            state = pool.submit(http, "GET", f"{urls[0]}/state?local_checkpoint_dir={local}")
            assert http("GET", f"{urls[0]}/healthz", token=None)[0] == 200, "loop blocked"
            gate.set()
            assert state.result()[1]["version"] == 2
        wait_durable(local)
        assert not (sync / "pending.json").exists()
        assert verify_local(local, published.store_dir, 2, base_dir=tmp_path / "base") == 2
    finally:
        gate.set()
        loop.call_soon_threadsafe(stop.set)
        thread.join(30)
