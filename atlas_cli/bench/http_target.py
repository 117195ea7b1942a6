"""Drive any OpenAI-compatible server (atlas serve, llama-server, vLLM) with streaming chat
completions, timing each request as MLPerf does: TTFT = first streamed token chunk - sent,
TPOT = (last chunk - first chunk) / (output tokens - 1), latency = complete - sent."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from atlas_cli.errors import AtlasError


class EndpointError(AtlasError):
    """The server could not be reached or answered with an error."""


@dataclass(frozen=True)
class Timing:
    ttft_s: float | None
    latency_s: float
    first_s: float | None  # first token chunk, from sending
    last_s: float | None  # last token chunk, from sending
    prompt_tokens: int | None
    completion_tokens: int
    cached_tokens: int | None
    finish_reason: str | None
    text: str


def chat_url(url: str) -> str:
    """Accept a server root, a /v1 base or the full chat completions URL."""
    url = url.rstrip("/")
    if url.endswith("/chat/completions"):
        return url
    if url.endswith("/v1"):
        return url + "/chat/completions"
    return url + "/v1/chat/completions"


def _delta_has_output(delta: dict[str, Any]) -> bool:
    return bool(
        delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
    ) or bool(delta.get("tool_calls"))


def _cached_tokens(chunk: dict[str, Any]) -> int | None:
    usage = chunk.get("usage") or {}
    details = usage.get("prompt_tokens_details") or {}
    if isinstance(details.get("cached_tokens"), int):
        return details["cached_tokens"]  # OpenAI / vLLM
    timings = chunk.get("timings") or {}
    if isinstance(timings.get("cache_n"), int):
        return timings["cache_n"]  # llama-server
    return None


class HttpTarget:
    def __init__(self, url: str, model: str, api_key: str | None = None, timeout: float = 600):
        import httpx2

        self.url = chat_url(url)
        self.model = model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx2.Client(headers=headers, timeout=httpx2.Timeout(timeout, connect=10))
        self._httpx = httpx2

    def close(self) -> None:
        self.client.close()

    def _chunks(self, resp) -> Iterator[dict[str, Any]]:
        """The JSON events of a streamed answer, up to `[DONE]`; server errors raised."""
        if resp.status_code != 200:
            detail = resp.read().decode("utf-8", "replace")[:300]
            raise EndpointError(f"{self.url} answered HTTP {resp.status_code}: {detail}")
        for line in resp.iter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            try:
                chunk = json.loads(data)
            except json.JSONDecodeError:
                raise EndpointError(f"{self.url} sent a malformed event: {data[:200]}") from None
            if "error" in chunk:
                raise EndpointError(f"{self.url} reported an error: {chunk['error']}")
            yield chunk

    def complete(
        self, messages: list[dict], tools: list[dict], max_tokens: int, seed: int = 42
    ) -> Timing:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "temperature": 0,
            "seed": seed,
            "max_tokens": max_tokens,  # older servers read only this one
            "max_completion_tokens": max_tokens,
        }
        if tools:
            body["tools"] = tools
        first = last = None
        chunks = 0
        usage: dict[str, Any] = {}
        cached = None
        finish = None
        pieces: list[str] = []
        t0 = time.perf_counter()
        try:
            with self.client.stream("POST", self.url, json=body) as resp:
                for chunk in self._chunks(resp):
                    now = time.perf_counter() - t0
                    for choice in chunk.get("choices") or []:
                        delta = choice.get("delta") or {}
                        if _delta_has_output(delta):
                            first = now if first is None else first
                            last = now
                            chunks += 1
                            pieces.append(delta.get("content") or "")
                        finish = choice.get("finish_reason") or finish
                    usage = chunk.get("usage") or usage
                    found = _cached_tokens(chunk)
                    cached = cached if found is None else found
        except self._httpx.HTTPError as exc:
            raise EndpointError(f"cannot reach {self.url}: {exc}") from None
        latency = time.perf_counter() - t0
        return Timing(
            ttft_s=first,
            latency_s=latency,
            first_s=first,
            last_s=last,
            prompt_tokens=usage.get("prompt_tokens"),
            completion_tokens=usage.get("completion_tokens", chunks),
            cached_tokens=cached,
            finish_reason=finish,
            text="".join(pieces),
        )
