"""The console's view of rank 0's HTTP server: health, served models, JSON and Prometheus
metrics, and the drain switch. Every call answers (an unreachable engine is a result, not an
exception), so pages render whatever state the engine is in."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol
from urllib.parse import quote, urlencode

import httpx

from dgpp.webui.deployments.store import EngineTarget


@dataclass(frozen=True)
class Health:
    """`/health` as the console saw it: status None when nothing answered."""

    status: int | None
    body: dict[str, Any] = field(default_factory=dict)
    error: str | None = None  # why nothing usable answered

    @property
    def is_serving(self) -> bool:
        return self.status == 200 and self.body.get("state") == "serving"

    @property
    def state(self) -> str:
        if self.status is None:
            return "unreachable"
        return str(self.body.get("state", "unknown"))

    @property
    def reason(self) -> str:
        """A one-line account of a health that is not serving."""
        if self.status is None:
            return f"the engine does not answer ({self.error})"
        text = str(self.body.get("error") or "")
        return f"{self.state}: {text}" if text else self.state


class EngineApi(Protocol):
    """What the console asks of the engine; tests replace it through `dependency_overrides`."""

    async def health(self) -> Health: ...

    async def metrics(self, model: str | None = None) -> dict[str, Any] | None:
        """`GET /v1/metrics` (`model`: a loaded side model's own; None when not loaded)."""
        ...

    async def prometheus(self, model: str | None = None) -> str | None:
        """The Prometheus text of `GET /metrics`; None when it does not answer 200."""
        ...

    async def models(self) -> list[str] | None: ...

    async def drain(self) -> dict[str, Any] | None: ...

    async def undrain(self) -> dict[str, Any] | None: ...

    async def reload(self) -> tuple[bool, str]: ...

    async def side_models(self) -> list[dict[str, Any]] | None:
        """The side models' cards of `GET /v1/models` (state, memory, last use...); None when
        the engine does not answer."""
        ...

    async def side_action(self, name: str, action: str) -> tuple[bool, str]:
        """POST /admin/models/{name}/{load|unload}: (True, its state now) or (False, why not)."""
        ...


class EngineClient:
    def __init__(self, target: EngineTarget, timeout_s: float = 5.0) -> None:
        self.target = target
        self.timeout_s = timeout_s

    async def _call(self, method: str, path: str) -> httpx.Response | str:
        """The response, or a short reason why there is none."""
        try:
            async with httpx.AsyncClient(timeout=self.timeout_s, trust_env=False) as client:
                return await client.request(
                    method, f"{self.target.url}{path}", headers=self.target.headers(path)
                )
        except httpx.TimeoutException:
            return f"no answer within {self.timeout_s:g} s"
        except httpx.HTTPError as err:
            return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__

    async def _json(self, method: str, path: str) -> dict[str, Any] | None:
        response = await self._call(method, path)
        if isinstance(response, str) or response.status_code != 200:
            return None
        try:
            body = response.json()
        except ValueError:
            return None
        return body if isinstance(body, dict) else None

    async def health(self) -> Health:
        response = await self._call("GET", "/health")
        if isinstance(response, str):
            return Health(None, error=response)
        try:
            body = response.json()
        except ValueError:
            body = {}
        if not isinstance(body, dict):
            body = {}
        return Health(response.status_code, body)

    async def metrics(self, model: str | None = None) -> dict[str, Any] | None:
        return await self._json("GET", "/v1/metrics" + _for(model))

    async def prometheus(self, model: str | None = None) -> str | None:
        response = await self._call("GET", "/metrics" + _for(model))
        if isinstance(response, str) or response.status_code != 200:
            return None
        return response.text

    async def models(self) -> list[str] | None:
        body = await self._json("GET", "/v1/models")
        if body is None:
            return None
        return [str(card.get("id")) for card in body.get("data", []) if isinstance(card, dict)]

    async def side_models(self) -> list[dict[str, Any]] | None:
        body = await self._json("GET", "/v1/models")
        if body is None:
            return None
        cards = [card for card in body.get("data", []) if isinstance(card, dict)]
        return [card for card in cards if "load" in card]  # the side models' cards say how

    async def side_action(self, name: str, action: str) -> tuple[bool, str]:
        body = await self._answer("POST", f"/admin/models/{quote(name, safe='')}/{action}")
        if isinstance(body, str):
            return False, body
        return True, str(body.get("state", "done"))

    async def drain(self) -> dict[str, Any] | None:
        return await self._json("POST", "/admin/drain")

    async def undrain(self) -> dict[str, Any] | None:
        return await self._json("POST", "/admin/undrain")

    async def reload(self) -> tuple[bool, str]:
        """POST /admin/reload (rank 0 takes its file's live knobs): (True, what it applied) or
        (False, why not, in rank 0's words)."""
        body = await self._answer("POST", "/admin/reload")
        if isinstance(body, str):
            return False, body
        applied = body.get("applied")
        if not isinstance(applied, dict):
            return False, "HTTP 200 without the changes applied"
        return True, ", ".join(f"{key} {old!r} -> {new!r}" for key, (old, new) in applied.items())

    async def _answer(self, method: str, path: str) -> dict[str, Any] | str:
        """A 200's JSON object, or why there is none (rank 0's error message where it sent
        one)."""
        response = await self._call(method, path)
        if isinstance(response, str):
            return response
        try:
            body = response.json()
        except ValueError:
            body = {}
        body = body if isinstance(body, dict) else {}
        if response.status_code == 200:
            return body
        error = body.get("error")
        message = error.get("message") if isinstance(error, dict) else None
        return message or f"HTTP {response.status_code}"


def _for(model: str | None) -> str:
    """The query that asks for a side model's own metrics."""
    return "" if model is None else "?" + urlencode({"model": model})
