"""``deltastore serve`` against what an attacker can send: cross-site and DNS-rebinding
requests, store files symlinked out of the allowed roots, a local dir inside the store, and
malformed input that must answer 400/401/413 with the JSON reply, never 500."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from deltastore import verify_local
from tests.pull.helpers import Published, many_tensors, publish_versions, write_checkpoint
from tests.pull.test_server import Server, start_server, stop_server


@dataclass
class Reply:
    status: int
    body: dict[str, object]


def raw_request(
    server: Server,
    method: str,
    path: str,
    body: bytes | None = None,
    headers: dict[str, str | bytes] | None = None,
) -> Reply:
    """One request with exactly the headers given (Host included), as a browser could send."""
    url = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    try:
        conn.putrequest(method, path, skip_host=True, skip_accept_encoding=True)
        sent = {"Host": url.netloc} | (headers or {})
        for key, value in sent.items():
            conn.putheader(key, value)
        if body is not None:
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    try:
        parsed = json.loads(data)
    except ValueError:
        raise AssertionError(
            f"HTTP {response.status} is not a JSON reply: {data[:200]!r}"
        ) from None
    return Reply(response.status, parsed)


def pull_json(local: Path, source: Path, version: int | str = 1) -> bytes:
    return json.dumps(
        {"local_checkpoint_dir": str(local), "source_dir": str(source), "target_version": version}
    ).encode()


JSON = {"Content-Type": "application/json"}


@pytest.fixture(scope="module")
def default_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Published, Server]]:
    """The server as the docs start it by default: loopback, no token, no --allow."""
    root = tmp_path_factory.mktemp("default-serve")
    base = many_tensors(6, seed=121, elements=128)
    write_checkpoint(root / "base", base)
    published = publish_versions(root / "store", root / "base", base, 2, seed=122)
    server = start_server("--base", str(root / "base"))
    yield published, server
    stop_server(server)


def assert_refused(reply: Reply, statuses: tuple[int, ...], word: str) -> None:
    assert reply.status in statuses, reply
    assert reply.body["success"] is False and word in str(reply.body["message"]).lower(), reply


def test_cross_site_and_rebinding_requests_are_refused(default_server, tmp_path: Path):
    published, server = default_server
    local = tmp_path / "victim"
    body = pull_json(local, published.store_dir)
    netloc = urllib.parse.urlsplit(server.url).netloc
    port = netloc.rsplit(":", 1)[1]
    # What a web page can make a browser send: a "simple" text/plain POST, no preflight.
    evil = {"Content-Type": "text/plain", "Origin": "http://evil.example"}
    assert_refused(raw_request(server, "POST", "/pull_weights", body, evil), (403, 415), "")
    # DNS rebinding: the page's own name resolves to 127.0.0.1, so Host and Origin agree.
    rebound = {"Host": f"evil.example:{port}", "Origin": f"http://evil.example:{port}"} | JSON
    assert_refused(raw_request(server, "POST", "/pull_weights", body, rebound), (403,), "host")
    no_origin = {"Host": f"evil.example:{port}"} | JSON
    assert_refused(raw_request(server, "POST", "/pull_weights", body, no_origin), (403,), "host")
    reply = raw_request(server, "GET", f"/state?local_checkpoint_dir={local}", None, no_origin)
    assert_refused(reply, (403,), "host")
    # A foreign page on the right host and port (or another local port), JSON or not.
    for origin in ("http://evil.example", "http://127.0.0.1:1", "null"):
        reply = raw_request(server, "POST", "/pull_weights", body, {"Origin": origin} | JSON)
        assert_refused(reply, (403,), "origin")
    for content_type in ("text/plain", "application/x-www-form-urlencoded", None):
        headers = {"Content-Type": content_type} if content_type else {}
        reply = raw_request(server, "POST", "/pull_weights", body, headers)
        assert_refused(reply, (415,), "application/json")
    assert not local.exists()
    # The server's own origin, a loopback Host spelled as a name, and plain JSON clients pass.
    own = {"Origin": server.url, "Content-Type": "application/json; charset=utf-8"}
    assert raw_request(server, "POST", "/pull_weights", body, own).status == 200
    localhost = {"Host": f"localhost:{port}"} | JSON
    assert raw_request(server, "POST", "/pull_weights", body, localhost).status == 200
    assert verify_local(local, published.store_dir, 1, published.base_dir) == 1


def test_malformed_input_answers_4xx_json_never_500(default_server, tmp_path: Path):
    published, server = default_server
    good = {
        "local_checkpoint_dir": str(tmp_path / "h"),
        "source_dir": str(published.store_dir),
        "target_version": 1,
    }
    for bad in (
        good | {"local_checkpoint_dir": str(tmp_path / "h\x00x")},
        good | {"source_dir": str(published.store_dir) + "\x00"},
        good | {"target_version": "9" * 5000},
        good | {"target_version": "9" * 40},
        good | {"target_version": 10**40},
    ):
        reply = raw_request(server, "POST", "/pull_weights", json.dumps(bad).encode(), JSON)
        assert reply.status == 400 and reply.body["success"] is False, (bad, reply)
    huge = json.dumps(good | {"target_version": 10**5000 // 10**800}).encode()  # 4201 digits
    assert raw_request(server, "POST", "/pull_weights", huge, JSON).status == 400
    reply = raw_request(server, "GET", "/state?local_checkpoint_dir=/tmp/a%00b")
    assert reply.status == 400 and reply.body["success"] is False
    too_big = json.dumps(good | {"pad": "x" * 100_000}).encode()
    reply = raw_request(server, "POST", "/pull_weights", too_big, JSON)
    assert reply.status == 413 and "bytes" in str(reply.body["message"])
    assert chunked_post(server, too_big).status == 413  # no Content-Length to refuse up front
    assert not (tmp_path / "h").exists()


def chunked_post(server: Server, body: bytes) -> Reply:
    url = urllib.parse.urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname or "", url.port, timeout=60)
    try:
        pieces = (body[i : i + 4096] for i in range(0, len(body), 4096))
        conn.request("POST", "/pull_weights", body=pieces, headers=JSON, encode_chunked=True)
        response = conn.getresponse()
        return Reply(response.status, json.loads(response.read()))
    finally:
        conn.close()


def test_allow_host_names_are_accepted(tmp_path: Path):
    write_checkpoint(tmp_path / "base", many_tensors(2, seed=126, elements=8))
    server = start_server("--base", str(tmp_path / "base"), "--allow-host", "Engine-3.example")
    port = urllib.parse.urlsplit(server.url).port
    try:
        for host, status in (("engine-3.example", 200), ("engine-4.example", 403)):
            headers = {"Host": f"{host}:{port}", "Origin": f"http://{host}:{port}"}
            reply = raw_request(
                server, "GET", f"/state?local_checkpoint_dir={tmp_path}/h", None, headers
            )
            assert reply.status == status, (host, reply)
        v6 = raw_request(server, "GET", "/healthz", None, {"Host": f"[::1]:{port}"})
        assert v6.status == 200 and v6.body["ok"] is True
        assert raw_request(server, "GET", "/nowhere").status == 404  # JSON too
    finally:
        stop_server(server)


def test_a_non_utf8_authorization_header_is_401(tmp_path: Path):
    write_checkpoint(tmp_path / "base", many_tensors(2, seed=123, elements=8))
    (tmp_path / "token").write_text("tok\n")
    server = start_server("--base", str(tmp_path / "base"), "--token-file", str(tmp_path / "token"))
    try:
        for header in (b"Bearer \xff\xfe", b"\xc3\x28", "Bearer tok\u00e9".encode()):
            reply = raw_request(
                server, "GET", "/state?local_checkpoint_dir=/x", None, {"Authorization": header}
            )
            assert reply.status == 401 and reply.body["success"] is False, (header, reply)
        reply = raw_request(
            server, "GET", "/state?local_checkpoint_dir=/x", None, {"Authorization": "Bearer tok"}
        )
        assert reply.status == 200
    finally:
        stop_server(server)


@pytest.fixture()
def two_tenants(tmp_path: Path) -> tuple[Published, Path, Path]:
    """A store under the allowed root ``allowed/run1`` and another tenant's tree outside it."""
    base = many_tensors(6, seed=124, elements=128)
    write_checkpoint(tmp_path / "base", base)
    allowed = tmp_path / "allowed"
    published = publish_versions(allowed / "run1", tmp_path / "base", base, 2, seed=125)
    other = tmp_path / "other-tenant"
    other.mkdir()
    return published, allowed, other


def test_store_files_symlinked_out_of_the_allowed_roots_are_refused(two_tenants):
    published, allowed, other = two_tenants
    version_dir = published.store_dir / "weight_v000001"
    shard = next(version_dir.glob("*.safetensors"))
    secret = other / "secret.safetensors"
    shutil.move(shard, secret)  # another tenant's file, reached through a link in this store
    shard.symlink_to(secret)
    server = start_server("--base", str(published.base_dir), "--allow", str(allowed))
    try:
        body = pull_json(allowed / "h", published.store_dir)
        reply = raw_request(server, "POST", "/pull_weights", body, JSON)
        assert_refused(reply, (403,), "symlink")
        assert str(shard.name) in str(reply.body["message"])
        assert not (allowed / "h").exists()
        # A version dir linked out of the allowed roots is refused the same way.
        shard.unlink()
        shutil.move(secret, shard)
        moved = other / "weight_v000002"
        shutil.move(published.store_dir / "weight_v000002", moved)
        (published.store_dir / "weight_v000002").symlink_to(moved)
        reply = raw_request(server, "POST", "/pull_weights", body, JSON)
        assert_refused(reply, (403,), "symlink")
        (published.store_dir / "weight_v000002").unlink()
        shutil.move(moved, published.store_dir / "weight_v000002")
        # A link that stays inside the allowed roots is fine, and a link loop ends the walk.
        shutil.move(shard, secret)
        inside = allowed / "moved.safetensors"
        shutil.move(secret, inside)
        shard.symlink_to(inside)
        (published.store_dir / "loop").symlink_to(published.store_dir)
        assert raw_request(server, "POST", "/pull_weights", body, JSON).status == 200
    finally:
        stop_server(server)


def test_a_local_dir_inside_or_holding_the_store_is_refused(two_tenants):
    published, allowed, _ = two_tenants
    store = published.store_dir
    index = store / "weight_v000002" / "model.safetensors.index.json"
    before = {p: p.read_bytes() for p in store.rglob("*") if p.is_file()}
    # The docs' own example: --allow /nvme --allow /shared/run1.
    server = start_server(
        "--base", str(published.base_dir), "--allow", str(allowed / "nvme"), "--allow", str(store)
    )
    try:
        for local in (store / "weight_v000002", store, store / "sub" / "deeper"):
            reply = raw_request(server, "POST", "/pull_weights", pull_json(local, store, 1), JSON)
            assert_refused(reply, (403,), "store")
        assert index.exists()
        assert {p: p.read_bytes() for p in store.rglob("*") if p.is_file()} == before
        ok = pull_json(allowed / "nvme" / "h", store, 2)
        assert raw_request(server, "POST", "/pull_weights", ok, JSON).status == 200
    finally:
        stop_server(server)
    assert os.path.isdir(allowed / "nvme" / "h")
