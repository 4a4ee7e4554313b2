"""The HTTP calls of each sync step, per engine (for :class:`~deltastore.engines.EngineSync`).

The routes and bodies are the engines' own (docs/engines.md names the versions they were
read from):

- vLLM (``VLLM_SERVER_DEV_MODE=1`` exposes them): ``POST /init_weight_transfer_engine
  {"init_info": {...}}``, ``POST /start_weight_update``, ``POST /update_weights
  {"update_info": {...}}``, ``POST /finish_weight_update {"weight_version": "N"}``,
  ``POST /pause?mode=...``, ``POST /resume``. Success is any 2xx; a failure is
  ``{"error": {"message": ...}}`` with a 4xx or 5xx.
- sglang: ``POST /pull_weights {local_checkpoint_dir, source_dir, target_version}`` answered
  ``{success, message}``; ``POST /pause_generation {"mode": ...}``, ``POST /flush_cache``
  (200, or 400 when requests are still running), ``POST /update_weights_from_disk
  {"model_path", "weight_version"}`` answered ``{success, message, num_paused_requests}``
  (200 or 400), ``POST /continue_generation {}``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from deltastore.errors import ConfigError, EngineSyncError
from deltastore.pull.client import EndpointReply, HttpReply, PullRequest, call, pull_all, pull_one

CONTROL_TIMEOUT_S = 600.0
"""Longest wait for a pause, resume, flush or init call."""


def _checked(reply: HttpReply) -> HttpReply:
    if not reply.ok:
        raise EngineSyncError(reply.describe())
    body = reply.json()
    if isinstance(body, dict) and body.get("success") is False:
        raise EngineSyncError(reply.describe())
    return reply


class Driver(Protocol):
    """The four steps of a sync for one engine; each raises :class:`EngineSyncError` with
    the failed call's reply (``EngineSync`` says what the failure means for the engine)."""

    def pull(self, version: int) -> list[EndpointReply]: ...

    def pause(self) -> None: ...

    def reload(self, version: int, *, retry: bool) -> None: ...

    def resume(self) -> None: ...


class VllmDriver:
    """vLLM with the ``deltastore`` weight-transfer backend (:mod:`deltastore.engines.vllm`)."""

    def __init__(
        self,
        url: str,
        init_info: Mapping[str, Any],
        token: str | None,
        pause_mode: str | None,
        timeout_s: float,
    ) -> None:
        self.url, self.token, self.pause_mode, self.timeout_s = url, token, pause_mode, timeout_s
        # Unset keys take the backend's defaults; engine_version None (unknown) must be sent.
        self.init_info = {
            k: v for k, v in init_info.items() if v is not None or k == "engine_version"
        }
        self.initialised = False

    def _post(self, path: str, body: Mapping[str, Any] | None = None, **kw: Any) -> HttpReply:
        kw.setdefault("timeout_s", CONTROL_TIMEOUT_S)
        return _checked(call(self.url, path, body, token=self.token, **kw))

    def _update(self, version: int, phase: str) -> None:
        """One weight update session: start, one update call, finish."""
        self._post("/start_weight_update")
        info = {"version": version, "phase": phase}
        self._post("/update_weights", {"update_info": info}, timeout_s=self.timeout_s)
        finish = {"weight_version": str(version)} if phase != "stage" else None
        self._post("/finish_weight_update", finish)

    def pull(self, version: int) -> list[EndpointReply]:
        if not self.initialised:
            self._post("/init_weight_transfer_engine", {"init_info": self.init_info})
            self.initialised = True
        self._update(version, "stage")
        return []

    def pause(self) -> None:
        query = {"mode": self.pause_mode} if self.pause_mode else None
        self._post("/pause", query=query)

    def reload(self, version: int, *, retry: bool) -> None:
        self._update(version, "reload" if retry else "commit")

    def resume(self) -> None:
        self._post("/resume")


class SglangDriver:
    """sglang: the engine's ``/pull_weights`` (or ``deltastore serve`` per host), then its
    own pause, flush, reload from disk and continue."""

    def __init__(
        self,
        url: str,
        source_dir: str | list[str],
        local_checkpoint_dir: str,
        token: str | None,
        pause_mode: str | None,
        timeout_s: float,
        *,
        serve_urls: list[str] | None,
        serve_dirs: str | Mapping[str, str],
        serve_token: str | None,
    ) -> None:
        if serve_urls is None and not isinstance(source_dir, str):
            raise ConfigError(
                "sglang's /pull_weights reads one source_dir; several stores (nearest first) "
                "need serve_urls (deltastore serve on each host)"
            )
        self.url, self.token, self.pause_mode, self.timeout_s = url, token, pause_mode, timeout_s
        self.source_dir, self.local_dir = source_dir, local_checkpoint_dir
        self.serve_urls, self.serve_dirs, self.serve_token = serve_urls, serve_dirs, serve_token

    def _post(self, path: str, body: Mapping[str, Any] | None = None, **kw: Any) -> HttpReply:
        kw.setdefault("timeout_s", CONTROL_TIMEOUT_S)
        return _checked(call(self.url, path, body, token=self.token, **kw))

    def pull(self, version: int) -> list[EndpointReply]:
        if self.serve_urls is not None:
            replies = pull_all(
                self.serve_urls,
                version,
                local_checkpoint_dir=self.serve_dirs,
                source_dir=self.source_dir,
                token=self.serve_token,
                timeout_s=self.timeout_s,
            )
        else:
            assert isinstance(self.source_dir, str)
            request = PullRequest(self.local_dir, self.source_dir, version)
            replies = [pull_one(self.url, request, token=self.token, timeout_s=self.timeout_s)]
        failed = [r.describe() for r in replies if not r.success]
        if failed:
            raise EngineSyncError(
                f"{len(failed)} of {len(replies)} host(s) failed: " + "; ".join(failed)
            )
        return replies

    def pause(self) -> None:
        self._post("/pause_generation", {"mode": self.pause_mode} if self.pause_mode else {})
        try:
            self._post("/flush_cache")
        except EngineSyncError as exc:
            self.resume()  # nothing was reloaded: serve on at the old version
            message = f"the cache flush failed ({exc}); the engine was resumed"
            raise EngineSyncError(message) from None

    def reload(self, version: int, *, retry: bool) -> None:
        if retry:  # verify every host's checkpoint again (a no-op pull checks the files)
            self.pull(version)
        body = {"model_path": self.local_dir, "weight_version": str(version)}
        self._post("/update_weights_from_disk", body, timeout_s=self.timeout_s)

    def resume(self) -> None:
        self._post("/continue_generation", {})


__all__ = ["CONTROL_TIMEOUT_S", "Driver", "SglangDriver", "VllmDriver"]
