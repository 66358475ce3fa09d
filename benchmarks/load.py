"""HTTP load generator for a running rnnserve: `rnnserve bench --url http://HOST:PORT`.

N workers share one aiohttp.ClientSession and send requests back to back until
the duration is over or the request budget is spent; every request has its
own timeout, and the whole run is cut at duration + timeout, so it always
ends. It talks only to the URL given.

Image requests POST /v1/images/completions with a synthetic 28x28 digit and
`keep_rows`; text requests POST /v1/completions with `stream: true` and read
the server-sent events up to `data: [DONE]`. Time to first token is taken
at the first event carrying a choice; inter-token latency is the gap between
consecutive such events (the server sends one per token, except that bytes
of an incomplete UTF-8 character are held back and sent together). Token
counts come from the server's `usage`.

The client is aiohttp, as vLLM's serving benchmark uses: on this project's
2-core machine the load generator shares the CPU with the server, and
httpx spent about six times more CPU per image request (measurements in
benchmarks/results/NOTES.md, "HTTP load generator").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from .errors import BenchError

IMAGE_PATH = "/v1/images/completions"
TEXT_PATH = "/v1/completions"
MAX_CONCURRENCY = 1024
MAX_DURATION_S = 3600.0


@dataclass(frozen=True)
class LoadSettings:
    url: str
    kind: str = "image"  # "image" or "text"
    concurrency: int = 8
    duration: float = 10.0  # seconds during which new requests start
    ramp_up: float = 0.0  # seconds over which the workers' first requests are spread evenly
    max_requests: int = 1000
    timeout: float = 120.0  # per request
    model: str | None = None
    keep_rows: int = 14
    max_tokens: int = 64
    prompt: str = "ROMEO:\n"
    temperature: float = 1.0
    api_key: str | None = None


@dataclass
class RequestRecord:
    outcome: str  # HTTP status as text ("200", "429"), or "timeout", "connect_error", "protocol_error"
    latency: float
    ttft: float | None = None
    gaps: list[float] = field(default_factory=list)
    tokens: int = 0
    images: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.outcome == "200" and self.error is None


def add_load_arguments(group) -> None:
    group.add_argument("--kind", choices=("image", "text"), default="image", help="image completions or streamed text")
    group.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    group.add_argument("--duration", type=float, default=10.0, help="seconds during which new requests start")
    group.add_argument(
        "--ramp-up",
        type=float,
        default=0.0,
        help="spread the workers' first requests evenly over this many seconds (default 0: all at once)",
    )
    group.add_argument("--requests", type=int, default=1000, help="at most this many requests in all")
    group.add_argument("--timeout", type=float, default=120.0, help="seconds allowed per request")
    group.add_argument("--model", help="model name to request (default: the server's choice)")
    group.add_argument("--keep-rows", type=int, default=14, help="image rows given; the rest are generated")
    group.add_argument("--max-tokens", type=int, default=64, help="text tokens per request")
    group.add_argument("--prompt", default="ROMEO:\n", help="text prompt")
    group.add_argument("--api-key", help="sent as Authorization: Bearer KEY")


def load_settings(args: argparse.Namespace) -> LoadSettings:
    settings = LoadSettings(
        url=args.url,
        kind=args.kind,
        concurrency=args.concurrency,
        duration=args.duration,
        ramp_up=args.ramp_up,
        max_requests=args.requests,
        timeout=args.timeout,
        model=args.model,
        keep_rows=args.keep_rows,
        max_tokens=args.max_tokens,
        prompt=args.prompt,
        api_key=args.api_key,
    )
    check_settings(settings)
    return settings


def check_settings(s: LoadSettings) -> None:
    parts = urlsplit(s.url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise BenchError(f"--url {s.url!r}: expected http://HOST:PORT (or https://)")
    if not 1 <= s.concurrency <= MAX_CONCURRENCY:
        raise BenchError(f"--concurrency must be between 1 and {MAX_CONCURRENCY}, got {s.concurrency}")
    if not 0 < s.duration <= MAX_DURATION_S:
        raise BenchError(f"--duration must be in (0, {MAX_DURATION_S:g}] seconds, got {s.duration}")
    if not 0 <= s.ramp_up < s.duration:
        raise BenchError(f"--ramp-up must be in [0, --duration) seconds, got {s.ramp_up} (duration {s.duration})")
    if s.max_requests < 1:
        raise BenchError(f"--requests must be >= 1, got {s.max_requests}")
    if not 0 < s.timeout <= MAX_DURATION_S:
        raise BenchError(f"--timeout must be in (0, {MAX_DURATION_S:g}] seconds, got {s.timeout}")
    if not 0 <= s.keep_rows < 28:
        raise BenchError(f"--keep-rows must be in 0..27 (rows of a 28x28 image kept), got {s.keep_rows}")
    if s.max_tokens < 1:
        raise BenchError(f"--max-tokens must be >= 1, got {s.max_tokens}")


# ---------------------------------------------------------------- request bodies


def synthetic_digit() -> list[list[int]]:
    """A 28x28 ring, zero-shaped: an image the server accepts, no data set needed."""
    y, x = np.mgrid[0:28, 0:28]
    r = np.hypot((y - 13.5) / 9.0, (x - 13.5) / 6.0)
    ring = np.clip(1.0 - np.abs(r - 1.0) * 4.0, 0.0, 1.0)
    return (ring * 255).round().astype(int).tolist()


def image_body(s: LoadSettings, index: int) -> dict:
    body = {"pixels": synthetic_digit(), "keep_rows": s.keep_rows, "n": 1, "seed": index, "temperature": s.temperature}
    return body | ({"model": s.model} if s.model else {})


def text_body(s: LoadSettings, index: int) -> dict:
    body = {
        "prompt": s.prompt,
        "max_tokens": s.max_tokens,
        "stream": True,
        "seed": index,
        "temperature": s.temperature,
        "stream_options": {"include_usage": True},
    }
    return body | ({"model": s.model} if s.model else {})


# ---------------------------------------------------------------- one request


async def image_request(session: aiohttp.ClientSession, s: LoadSettings, index: int) -> RequestRecord:
    start = time.perf_counter()
    async with session.post(s.url.rstrip("/") + IMAGE_PATH, json=image_body(s, index)) as response:
        raw = await response.read()
    record = RequestRecord(str(response.status), time.perf_counter() - start)
    if response.status == 200:
        try:
            body = json.loads(raw)
            record.images = len(body["data"])
            record.tokens = int(body["usage"]["pixels_generated"])
        except (ValueError, KeyError, TypeError) as exc:
            record.error = f"bad response body: {exc}"
    return record


async def text_request(session: aiohttp.ClientSession, s: LoadSettings, index: int) -> RequestRecord:
    start = time.perf_counter()
    async with session.post(s.url.rstrip("/") + TEXT_PATH, json=text_body(s, index)) as response:
        record = RequestRecord(str(response.status), 0.0)
        if response.status == 200:
            await _read_events(response, record, start)
        else:
            await response.read()
    record.latency = time.perf_counter() - start
    return record


async def _read_events(response: aiohttp.ClientResponse, record: RequestRecord, start: float) -> None:
    """Consume `data: {...}` events until `data: [DONE]`, timing each text event."""
    last = None
    done = False
    async for raw in response.content:  # one line at a time, with its line break
        line = raw.decode("utf-8").rstrip("\r\n")
        if not line.startswith("data:"):
            continue
        payload = line[5:].strip()
        if payload == "[DONE]":
            done = True
            break
        chunk = json.loads(payload)
        if "error" in chunk:  # failed after the 200 status line: reported in-band
            record.error = f"in-stream error: {chunk['error'].get('message')}"
            continue
        if chunk.get("usage"):
            record.tokens = int(chunk["usage"]["completion_tokens"])
        if not chunk.get("choices"):
            continue
        now = time.perf_counter()
        if last is None:
            record.ttft = now - start
        else:
            record.gaps.append(now - last)
        last = now
    if not done and record.error is None:
        record.error = "stream ended without data: [DONE]"


# ---------------------------------------------------------------- the run


async def _worker(
    session: aiohttp.ClientSession, s: LoadSettings, budget: dict, records: list[RequestRecord], delay: float
) -> None:
    send = image_request if s.kind == "image" else text_request
    await asyncio.sleep(delay)
    budget["first_sends"].append(time.perf_counter() - budget["start"])
    while time.perf_counter() < budget["deadline"] and budget["issued"] < s.max_requests:
        index = budget["issued"]
        budget["issued"] += 1
        start = time.perf_counter()
        try:
            records.append(await send(session, s, index))
        except TimeoutError:  # aiohttp's timeouts are TimeoutErrors (asyncio's too, since Python 3.11)
            records.append(RequestRecord("timeout", time.perf_counter() - start))
        except aiohttp.ClientConnectorError as exc:
            records.append(RequestRecord("connect_error", time.perf_counter() - start, error=str(exc)))
        except (aiohttp.ClientError, ValueError) as exc:
            records.append(RequestRecord("protocol_error", time.perf_counter() - start, error=str(exc)))


async def run_load_async(s: LoadSettings) -> dict:
    check_settings(s)
    headers = {"Authorization": f"Bearer {s.api_key}"} if s.api_key else {}
    records: list[RequestRecord] = []
    start = time.perf_counter()
    budget = {"start": start, "deadline": start + s.duration, "issued": 0, "first_sends": []}
    connector = aiohttp.TCPConnector(limit=s.concurrency)  # one keep-alive connection per worker
    async with aiohttp.ClientSession(
        headers=headers, timeout=aiohttp.ClientTimeout(total=s.timeout), connector=connector, trust_env=False
    ) as session:
        workers = [
            asyncio.create_task(_worker(session, s, budget, records, i * s.ramp_up / s.concurrency))
            for i in range(s.concurrency)
        ]
        # Hard stop: no request may outlive duration + its own timeout.
        _, pending = await asyncio.wait(workers, timeout=s.duration + s.timeout + 5.0)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    elapsed = time.perf_counter() - start
    return summarize(s, records, elapsed, cut=len(pending)) | {"first_sends_s": sorted(budget["first_sends"])}


def run_load(s: LoadSettings) -> dict:
    return asyncio.run(run_load_async(s))


# ---------------------------------------------------------------- summary


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "count": 0}
    arr = np.asarray(values)
    return {"p50": float(np.percentile(arr, 50)), "p99": float(np.percentile(arr, 99)), "count": len(values)}


def _label(r: RequestRecord) -> str:
    return "200 with error" if r.outcome == "200" and r.error else r.outcome


def summarize(s: LoadSettings, records: list[RequestRecord], elapsed: float, cut: int = 0) -> dict:
    ok = [r for r in records if r.ok]
    images = sum(r.images for r in ok)
    tokens = sum(r.tokens for r in ok)
    return {
        "settings": asdict(s) | {"api_key": "***" if s.api_key else None},
        "elapsed_s": elapsed,
        "sent": len(records),
        "completed": len(ok),
        "outcomes": dict(sorted(Counter(_label(r) for r in records).items())),
        "workers_cut_at_hard_stop": cut,
        "requests_per_s": len(ok) / elapsed,
        "images_per_s": images / elapsed,
        "images": images,
        "tokens": tokens,
        "tokens_per_s": tokens / elapsed,
        "latency_s": _percentiles([r.latency for r in ok]),
        "ttft_s": _percentiles([r.ttft for r in ok if r.ttft is not None]),
        "inter_token_s": _percentiles([g for r in ok for g in r.gaps]),
        "errors": [r.error for r in records if r.error][:10],
    }


def summary_text(result: dict) -> str:
    def ms(d: dict, key: str) -> str:
        v = d[key]
        return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v * 1e3:,.1f} ms"

    s = result["settings"]
    lines = [
        f"{s['kind']} load on {s['url']}: concurrency {s['concurrency']}, {result['elapsed_s']:.1f} s, "
        f"{result['sent']} sent, {result['completed']} completed",
        f"outcomes: {', '.join(f'{k}: {v}' for k, v in result['outcomes'].items()) or 'none'}",
        f"requests/s {result['requests_per_s']:.2f}   images/s {result['images_per_s']:.2f}   "
        f"tokens/s {result['tokens_per_s']:,.1f}",
        f"latency p50 {ms(result['latency_s'], 'p50')}  p99 {ms(result['latency_s'], 'p99')}",
        f"time to first token p50 {ms(result['ttft_s'], 'p50')}  p99 {ms(result['ttft_s'], 'p99')}",
        f"inter-token latency p50 {ms(result['inter_token_s'], 'p50')}  p99 {ms(result['inter_token_s'], 'p99')}",
    ]
    if result["errors"]:
        lines.append("first errors: " + "; ".join(result["errors"][:3]))
    return "\n".join(lines)
