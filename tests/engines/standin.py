"""Stand-in engine servers for the tests: the HTTP routes, request bodies and replies of
sglang and vLLM, with real weights behind them and faults to inject.

They are stand-ins, not the engines. Their shapes follow:

- sglang 0.5.23 (release wheel, ``sglang/srt/entrypoints/http_server.py`` and
  ``managers/io_struct.py``): ``/pause_generation {"mode"}``, ``/flush_cache`` (200, 400 when
  it cannot flush), ``/update_weights_from_disk {"model_path", "weight_version", ...}`` →
  ``{success, message, num_paused_requests}`` with 200/400, ``/continue_generation {}``; and
  ``/pull_weights {local_checkpoint_dir, source_dir, target_version}`` → ``{success, message}``
  of sgl-project/sglang PR #30366 (the sglang-miles branch, read at commit a0a0fb8b16a4):
  one call fans out to every host of the engine and succeeds only if every host did.
- vLLM 0.33.0 (release wheel, ``vllm/entrypoints/rl/online/api_router.py`` and
  ``vllm/v1/worker/gpu_worker.py``): ``/init_weight_transfer_engine {"init_info"}``,
  ``/start_weight_update``, ``/update_weights {"update_info"}``, ``/finish_weight_update
  {"weight_version"}``, ``/pause?mode=``, ``/resume``; worker errors answer
  ``{"error": {"message", "type", "param", "code"}}`` (400 for a ``ValueError``, else 500).

An sglang "host" is a directory root: every path a request names is read under it, as a
container mount would (host 0 of a one-host engine is the machine itself).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from aiohttp import web
from safetensors.torch import load_file

import deltastore as ds
from deltastore.format.checkpoint import checkpoint_files


def load_checkpoint(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF checkpoint dir (what an engine's reload from disk reads)."""
    out: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(str(directory)):
        # Copies: an engine holds its weights in its own memory, not mapped from the files a
        # later pull patches in place.
        out.update({n: t.clone() for n, t in load_file(file).items()})
    return out


@dataclass
class EngineState:
    """What the stand-in engine did, and the faults it will inject."""

    calls: list[str] = field(default_factory=list)
    """Routes called, in order."""
    bodies: list[Any] = field(default_factory=list)
    paused: bool = False
    weights: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    """sglang: host → the weights it serves (what the last reload loaded)."""
    weight_version: str | None = None
    fail_reloads: int = 0
    """Fail this many reload calls from now on (then succeed)."""
    fail_pull_hosts: set[int] = field(default_factory=set)
    fail_flush: bool = False


def _json(body: dict[str, Any], status: int = 200) -> web.Response:
    return web.json_response(body, status=status)


class SglangStandIn:
    """sglang's weight-sync routes over ``hosts`` (directory roots), base model ``model_path``."""

    def __init__(self, model_path: Path, hosts: list[Path] | None = None) -> None:
        self.model_path = model_path
        self.hosts = hosts if hosts is not None else [Path("/")]
        self.state = EngineState()
        base = load_checkpoint(model_path)
        self.state.weights = {h: dict(base) for h in range(len(self.hosts))}

    def on(self, host: int, path: str) -> Path:
        """``path`` as host ``host`` sees it."""
        return self.hosts[host] / path.lstrip("/")

    async def _record(self, request: web.Request) -> Any:
        self.state.calls.append(request.path)
        body = await request.json() if request.can_read_body else None
        self.state.bodies.append(body)
        return body

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/pull_weights", self.pull_weights)
        app.router.add_post("/pause_generation", self.pause)
        app.router.add_route("*", "/flush_cache", self.flush)
        app.router.add_post("/update_weights_from_disk", self.reload)
        app.router.add_post("/continue_generation", self.resume)
        return app

    async def pull_weights(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        errors = []
        for host in range(len(self.hosts)):
            if host in self.state.fail_pull_hosts:
                errors.append(f"host {host}: injected pull failure")
                continue
            try:
                await asyncio.to_thread(
                    ds.pull_weights,
                    self.on(host, body["local_checkpoint_dir"]),
                    body["source_dir"],
                    body["target_version"],
                    base_dir=self.model_path,
                )
            except ds.DeltastoreError as exc:
                errors.append(f"host {host}: {exc}")
        if errors:
            return _json({"success": False, "message": "; ".join(errors)}, 400)
        return _json({"success": True, "message": "Success."})

    async def pause(self, request: web.Request) -> web.Response:
        await self._record(request)
        self.state.paused = True
        return _json({"message": "Generation paused successfully.", "status": "ok"})

    async def flush(self, request: web.Request) -> web.Response:
        await self._record(request)
        if self.state.fail_flush or not self.state.paused:
            return web.Response(text="Flush cache failed.\n", status=400)
        return web.Response(text="Cache flushed.\n")

    async def reload(self, request: web.Request) -> web.Response:
        body = await self._record(request)
        if self.state.fail_reloads > 0:
            self.state.fail_reloads -= 1
            for host in self.state.weights:  # a reload that died half way
                name = sorted(self.state.weights[host])[0]
                self.state.weights[host][name] = torch.zeros_like(self.state.weights[host][name])
            reply = {"success": False, "message": "injected: CUDA error", "num_paused_requests": 0}
            return _json(reply, 400)
        for host in range(len(self.hosts)):
            loaded = await asyncio.to_thread(load_checkpoint, self.on(host, body["model_path"]))
            self.state.weights[host] = loaded
        self.state.weight_version = body.get("weight_version")
        return _json(
            {
                "success": True,
                "message": "Succeeded to update model weights.",
                "num_paused_requests": 0,
            }
        )

    async def resume(self, request: web.Request) -> web.Response:
        await self._record(request)
        self.state.paused = False
        return _json({"message": "Generation continued successfully.", "status": "ok"})


class VllmStandIn:
    """vLLM's RL routes in front of one worker's weight-transfer ``backend`` (any object with
    vLLM's ``parse_init_info``/``init_transfer_engine``/``start_weight_update``/
    ``update_weights``/``finish_weight_update`` methods, e.g. the deltastore receiver)."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.state = EngineState()
        self.active = False
        self.fail_updates: Callable[[dict[str, Any]], bool] = lambda info: False
        """Inject a failure into the update calls this returns True for."""

    def app(self) -> web.Application:
        app = web.Application()
        for route in (
            "init_weight_transfer_engine",
            "start_weight_update",
            "update_weights",
            "finish_weight_update",
            "pause",
            "resume",
        ):
            app.router.add_post(f"/{route}", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.Response:
        route = request.path.strip("/")
        self.state.calls.append(route if route != "update_weights" else "update_weights")
        body = await request.json() if request.can_read_body else None
        self.state.bodies.append(body)
        try:
            return _json(await asyncio.to_thread(self._run, route, body, request.query))
        except ValueError as exc:
            return self._error(exc, 400)
        except Exception as exc:  # vLLM's safety-net handler: 500 with the message
            return self._error(exc, 500)

    @staticmethod
    def _error(exc: Exception, code: int) -> web.Response:
        kind = "BadRequestError" if code == 400 else "InternalServerError"
        body = {"error": {"message": str(exc), "type": kind, "param": None, "code": code}}
        return _json(body, code)

    def _run(self, route: str, body: Any, query: Any) -> dict[str, Any]:
        b = self.backend
        if route == "init_weight_transfer_engine":
            b.init_transfer_engine(b.parse_init_info(body["init_info"]))
            return {"message": "Weight transfer initialized"}
        if route == "start_weight_update":
            if self.active:
                raise RuntimeError("start_weight_update called while a weight update is active")
            b.start_weight_update()
            self.active = True
            return {"message": "Weight update started"}
        if route == "update_weights":
            if not self.active:
                raise RuntimeError("start_weight_update must be called before update_weights.")
            info = body["update_info"]
            try:
                if self.fail_updates(info):
                    raise RuntimeError(f"injected: CUDA error in update {json.dumps(info)}")
                b.update_weights(info)
            except BaseException:
                self.active = False  # as vLLM's worker does
                raise
            return {"message": "Weights updated"}
        if route == "finish_weight_update":
            if not self.active:
                raise RuntimeError("finish_weight_update called without a matching start.")
            b.finish_weight_update()
            self.active = False
            if body and body.get("weight_version") is not None:
                self.state.weight_version = body["weight_version"]
            return {"message": "Weight update finished"}
        if route == "pause":
            if query.get("mode", "abort") not in ("abort", "wait", "keep"):
                raise ValueError(f"bad pause mode {query.get('mode')!r}")
            self.state.paused = True
            return {"status": "paused"}
        self.state.paused = False
        return {"status": "resumed"}
