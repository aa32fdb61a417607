"""A small client for llama-server's native /completion endpoint.

A server started with an API key (see `ikdflash serve`) wants it with every request: pass
``api_key=``, or set IKDFLASH_API_KEY, which every call here uses when no key is given.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from ikdflash.serving.server import ServerError


@dataclass
class Completion:
    text: str
    pieces: list[str] = field(default_factory=list)
    """The text of each generated token (filled when ``pieces=True`` was asked)."""
    timings: dict[str, Any] = field(default_factory=dict)
    raw: dict[str, Any] = field(default_factory=dict)


def _request(url: str, body: dict[str, Any] | None, api_key: str | None) -> urllib.request.Request:
    """A POST of body as JSON, or a GET when body is None."""
    headers = {"Content-Type": "application/json"}
    api_key = api_key or os.environ.get("IKDFLASH_API_KEY")
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return urllib.request.Request(url, data=None if body is None else json.dumps(body).encode(), headers=headers)


def post_json(url: str, body: dict[str, Any] | None, timeout: float = 300.0,
              api_key: str | None = None) -> dict[str, Any]:
    """POST body (GET when it is None) and return the JSON reply."""
    try:
        with urllib.request.urlopen(_request(url, body, api_key), timeout=timeout) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as e:
        raise ServerError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')}") from None


def get_json(url: str, timeout: float = 300.0, api_key: str | None = None) -> dict[str, Any]:
    return post_json(url, None, timeout, api_key)


def stream_json(url: str, body: dict[str, Any], timeout: float = 300.0,
                api_key: str | None = None) -> Iterator[dict[str, Any]]:
    """POST body with "stream": true and yield each server-sent event (a JSON object) as it
    arrives, on the native and the OpenAI endpoints. Closing the generator early (break, or
    .close()) hangs up, which makes the server cancel the request."""
    try:
        with urllib.request.urlopen(_request(url, {**body, "stream": True}, api_key), timeout=timeout) as response:
            for line in response:
                if line.strip() == b"data: [DONE]":  # the OpenAI endpoints' last event
                    return
                if line.startswith(b"data: "):
                    event = json.loads(line[len(b"data: "):])
                    yield event
                    if event.get("stop"):
                        return
    except urllib.error.HTTPError as e:
        raise ServerError(f"{url}: HTTP {e.code}: {e.read().decode(errors='replace')}") from None


def post_json_concurrently(url: str, bodies: Sequence[dict[str, Any]], timeout: float = 300.0,
                           api_key: str | None = None, in_flight: int | None = None) -> list[dict[str, Any]]:
    """POST every body to url at the same time (one thread each), or with in_flight: that many at a
    time, each next body sent as soon as a reply comes back; the replies, in order."""
    with ThreadPoolExecutor(max_workers=max(1, in_flight or len(bodies))) as pool:
        return list(pool.map(lambda body: post_json(url, body, timeout, api_key), bodies))


def complete(base_url: str, prompt: str | Sequence[int], *, max_tokens: int = 64, temperature: float = 0.0,
             seed: int | None = None, pieces: bool = False, api_key: str | None = None,
             **extra: Any) -> Completion:
    """POST /completion. ``prompt`` is text or token ids; ``extra`` goes into the request body."""
    body: dict[str, Any] = {"prompt": prompt if isinstance(prompt, str) else list(prompt),
                            "n_predict": max_tokens, "temperature": temperature, "cache_prompt": False, **extra}
    if seed is not None:
        body["seed"] = seed
    if pieces:
        # The server reports per-token text only through its probabilities output.
        body["n_probs"] = 1
    reply = post_json(base_url.rstrip("/") + "/completion", body, api_key=api_key)
    token_pieces = [entry["content"] if "content" in entry else entry.get("tok_str", "")
                    for entry in reply.get("completion_probabilities", [])]
    return Completion(text=reply.get("content", ""), pieces=token_pieces, timings=reply.get("timings", {}), raw=reply)
