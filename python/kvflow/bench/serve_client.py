"""The load generator: sends benchmark requests to an OpenAI-compatible server as streamed
completions, at a chosen arrival rate and concurrency, and times each one."""

import asyncio
import codecs
import contextlib
import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import httpx
import numpy as np
from tqdm import tqdm

from kvflow.bench.datasets import BenchRequest
from kvflow.bench.latency_stats import RequestRecord
from kvflow.tokenizer import Tokenizer

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")


class ServerSentEvents:
    """Splits a byte stream into the data of its server-sent events. Bytes arrive in arbitrary
    pieces: a line, or a UTF-8 character, may be cut between two reads."""

    def __init__(self):
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pending = ""
        self._data_lines: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        """The data of the events that `chunk` completes."""
        *lines, self._pending = (self._pending + self._decoder.decode(chunk)).split("\n")
        return self._read_lines(lines)

    def close(self) -> list[str]:
        """The data of an event the stream ended without a blank line after."""
        lines = [self._pending + self._decoder.decode(b"", final=True), ""]
        self._pending = ""
        return self._read_lines(lines)

    def _read_lines(self, lines: list[str]) -> list[str]:
        events = []
        for line in lines:
            line = line.rstrip("\r")
            if not line:
                if self._data_lines:
                    events.append("\n".join(self._data_lines))
                    self._data_lines = []
            elif line.startswith("data:"):
                value = line[len("data:"):]
                self._data_lines.append(value[1:] if value.startswith(" ") else value)
            # other fields (event:, id:, retry:) and comments (": ...") carry nothing we use
        return events


class StreamedCompletion:
    """The events of one streamed (chat) completion: its text, when each text chunk came, the
    server's token count and any error."""

    def __init__(self, start: float):
        self.start = start
        self.text_parts: list[str] = []
        self.ttft: float | None = None
        self.itls: list[float] = []
        self.completion_tokens: int | None = None
        self.error = ""
        self.done = False
        self._last_text_time = start

    def add_event(self, data: str, now: float) -> None:
        if data.strip() == "[DONE]":
            self.done = True
            return
        event = json.loads(data)
        if "error" in event or event.get("object") == "error":
            error = event.get("error", event)
            self.error = error.get("message", str(error)) if isinstance(error, dict) else str(error)
            return
        for choice in event.get("choices") or []:
            text = choice.get("text") if "delta" not in choice else choice["delta"].get("content")
            if text:
                self._add_text(text, now)
        usage = event.get("usage")
        if usage and usage.get("completion_tokens") is not None:
            self.completion_tokens = usage["completion_tokens"]

    def _add_text(self, text: str, now: float) -> None:
        if self.ttft is None:
            self.ttft = now - self.start
        else:
            self.itls.append(now - self._last_text_time)
        self._last_text_time = now
        self.text_parts.append(text)


def arrival_offsets(num: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """When each request is sent, in seconds from the start; the first at 0. Gaps are drawn
    from a gamma distribution with mean 1 / request_rate and shape `burstiness` (1: a Poisson
    process; below 1 burstier, above 1 more even); an infinite rate sends all at once."""
    if request_rate <= 0 or burstiness <= 0:
        raise ValueError("the request rate and the burstiness must be positive")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=max(num - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:num]


def request_payload(endpoint: str, model: str, request: BenchRequest, ignore_eos: bool) -> dict:
    payload = {
        "model": model,
        "max_tokens": request.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": ignore_eos,
        "temperature": 0,
    }
    if endpoint == "/v1/chat/completions":
        payload["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        payload["prompt"] = request.prompt
    return payload


async def send_request(client: httpx.AsyncClient, url: str, payload: dict, request: BenchRequest,
                       tokenizer: Tokenizer | None, benchmark_start: float) -> RequestRecord:
    record = RequestRecord(prompt_len=request.prompt_len)
    start = time.perf_counter()
    record.start_time = start - benchmark_start
    stream = StreamedCompletion(start)
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode("utf-8", errors="replace")
                record.error = f"HTTP {response.status_code}: {body[:500]}"
                return record
            events = ServerSentEvents()
            async for chunk in response.aiter_bytes():
                now = time.perf_counter()
                for data in events.feed(chunk):
                    stream.add_event(data, now)
            for data in events.close():
                stream.add_event(data, time.perf_counter())
    except Exception as error:  # one failed request must not end the benchmark
        record.error = f"{type(error).__name__}: {error}"
        return record
    record.e2e_latency = time.perf_counter() - start

    if stream.error:
        record.error = stream.error
    elif not stream.done:
        record.error = "the stream ended before data: [DONE]"
    elif stream.ttft is None:
        record.error = "the stream carried no text"
    else:
        record.success = True
        record.ttft = stream.ttft
        record.itls = stream.itls
        if stream.completion_tokens is not None:
            record.output_len = stream.completion_tokens
        elif tokenizer is not None:
            record.output_len = len(tokenizer.encode("".join(stream.text_parts), add_special_tokens=False))
        else:
            record.output_len = len(stream.text_parts)  # one token per chunk, the best guess left
    return record


def _auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def run_benchmark(requests: list[BenchRequest], *, base_url: str, model: str,
                        endpoint: str = "/v1/completions", request_rate: float = math.inf,
                        burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                        ignore_eos: bool = True, api_key: str | None = None,
                        tokenizer: Tokenizer | None = None,
                        show_progress: bool = True) -> tuple[list[RequestRecord], float]:
    """Sends every request and returns their records (in the order of `requests`) and the
    wall-clock duration of the run in seconds."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unsupported endpoint {endpoint!r}; supported: {', '.join(ENDPOINTS)}")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be at least 1, got {max_concurrency}")
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    url = base_url.rstrip("/") + endpoint
    connections = max(1, max_concurrency or len(requests))
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    # Under load a server may take minutes to answer; only connecting is bounded.
    timeout = httpx.Timeout(None, connect=60.0)
    limiter = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    progress = tqdm(total=len(requests), desc="requests", disable=not show_progress)

    async with httpx.AsyncClient(limits=limits, timeout=timeout, headers=_auth_headers(api_key)) as client:
        benchmark_start = time.perf_counter()

        async def send_when_allowed(request: BenchRequest) -> RequestRecord:
            async with limiter:
                payload = request_payload(endpoint, model, request, ignore_eos)
                record = await send_request(client, url, payload, request, tokenizer, benchmark_start)
            progress.update(1)
            return record

        tasks = []
        for request, offset in zip(requests, offsets):
            delay = benchmark_start + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(send_when_allowed(request)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - benchmark_start
    progress.close()
    return list(records), duration


def fetch_model_id(base_url: str, api_key: str | None = None) -> str:
    """The first model the server lists at GET /v1/models."""
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=_auth_headers(api_key), timeout=30.0)
    response.raise_for_status()
    models = response.json().get("data") or []
    if not models:
        raise RuntimeError(f"{base_url}/v1/models lists no models; pass --model")
    return models[0]["id"]


_SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def fetch_spec_decode_counters(base_url: str, api_key: str | None = None) -> dict | None:
    """The server's speculative-decoding counters from GET /metrics (kvflow:spec_decode_*, summed
    over models): {num_drafts, num_draft_tokens, num_accepted_tokens, accepted_per_position}, or
    None where the server has none (no speculation, or no metrics)."""
    try:
        response = httpx.get(base_url.rstrip("/") + "/metrics", headers=_auth_headers(api_key), timeout=30.0)
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    counters = {name: 0.0 for name in _SPEC_COUNTERS}
    per_position: dict[int, float] = {}
    found = False
    for line in response.text.splitlines():
        if not line.startswith("kvflow:spec_decode_"):
            continue
        name, _, value = line.rpartition(" ")
        metric = name.split("{")[0].removeprefix("kvflow:spec_decode_").removesuffix("_total")
        if metric == "num_accepted_tokens_per_pos":
            position = int(name.split('position="')[1].split('"')[0])
            per_position[position] = per_position.get(position, 0.0) + float(value)
        elif metric in counters:
            counters[metric] += float(value)
            found = True
    if not found:
        return None
    counters["accepted_per_position"] = [per_position[p] for p in sorted(per_position)]
    return counters


def spec_decode_summary(before: dict | None, after: dict | None) -> dict | None:
    """What the benchmark's requests drafted and accepted (after - before), as vLLM's bench
    serve reports it: acceptance rate, acceptance length (tokens per verification, the target's
    own included) and the acceptance rate at each draft position."""
    if before is None or after is None:
        return None
    delta = {name: after[name] - before[name] for name in _SPEC_COUNTERS}
    drafts, proposed = delta["num_drafts"], delta["num_draft_tokens"]
    positions = [a - b for a, b in zip(after["accepted_per_position"], before["accepted_per_position"])]
    return {**{name: int(value) for name, value in delta.items()},
            "acceptance_rate": delta["num_accepted_tokens"] / proposed if proposed else None,
            "acceptance_length": 1 + delta["num_accepted_tokens"] / drafts if drafts else None,
            "acceptance_rate_per_position": [count / drafts for count in positions] if drafts else []}


def wait_until_ready(base_url: str, timeout: float, interval: float = 0.5) -> None:
    """Polls GET /health, then /v1/models, until the server answers 200; TimeoutError after
    `timeout` seconds."""
    deadline = time.monotonic() + timeout
    last_problem = "no answer"
    while True:
        for path in ("/health", "/v1/models"):
            try:
                response = httpx.get(base_url.rstrip("/") + path, timeout=max(interval, 1.0))
                if response.status_code == 200:
                    return
                last_problem = f"GET {path}: HTTP {response.status_code}"
            except httpx.HTTPError as error:
                last_problem = f"GET {path}: {type(error).__name__}: {error}"
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the server at {base_url} was not ready after {timeout:g} s ({last_problem})")
        time.sleep(interval)


def format_summary(summary: dict) -> str:
    """The summary as a table, one line a figure."""
    def row(label: str, value) -> str:
        if value is None:
            text = "n/a"
        elif isinstance(value, float):
            text = f"{value:.2f}"
        else:
            text = str(value)
        return f"{label:<40}{text:<10}"

    lines = [f"{' Serving Benchmark Result ':=^50}",
             row("Successful requests:", summary["completed"]),
             row("Failed requests:", summary["failed"]),
             row("Benchmark duration (s):", summary["duration"]),
             row("Total input tokens:", summary["total_input_tokens"]),
             row("Total generated tokens:", summary["total_output_tokens"]),
             row("Request throughput (req/s):", summary["request_throughput"]),
             row("Output token throughput (tok/s):", summary["output_throughput"]),
             row("Total token throughput (tok/s):", summary["total_token_throughput"])]
    if "goodput" in summary:
        lines.append(row("Request goodput (req/s):", summary["goodput"]))
        attainment = summary["slo_attainment"]
        lines.append(row("SLO attainment (%):", None if attainment is None else attainment * 100))
    spec = summary.get("spec_decode")
    if spec is not None:
        lines.append(f"{' Speculative Decoding ':-^50}")
        lines.append(row("Acceptance rate (%):", None if spec["acceptance_rate"] is None
                         else spec["acceptance_rate"] * 100))
        lines.append(row("Acceptance length:", spec["acceptance_length"]))
        lines.append(row("Drafts:", spec["num_drafts"]))
        lines.append(row("Draft tokens:", spec["num_draft_tokens"]))
        lines.append(row("Accepted tokens:", spec["num_accepted_tokens"]))
        for position, rate in enumerate(spec["acceptance_rate_per_position"]):
            lines.append(row(f"Acceptance rate at position {position} (%):", rate * 100))
    sections = [("ttft", "TTFT", "Time to First Token"), ("tpot", "TPOT", "Time per Output Token (excl. 1st)"),
                ("itl", "ITL", "Inter-token Latency"), ("e2e", "E2E", "End-to-end Latency")]
    for key, short, title in sections:
        lines.append(f"{' ' + title + ' ':-^50}")
        lines.append(row(f"Mean {short} (ms):", summary[f"mean_{key}_ms"]))
        lines.append(row(f"Median {short} (ms):", summary[f"p50_{key}_ms"]))
        lines.append(row(f"P95 {short} (ms):", summary[f"p95_{key}_ms"]))
        lines.append(row(f"P99 {short} (ms):", summary[f"p99_{key}_ms"]))
    lines.append("=" * 50)
    return "\n".join(lines)


def write_results(result_dir: str | Path, name: str, summary: dict, settings: dict,
                  records: list[RequestRecord]) -> tuple[Path, Path]:
    """`{name}.json`: the settings and the summary; `{name}-requests.jsonl`: one record a line."""
    result_dir = Path(result_dir)
    result_dir.mkdir(parents=True, exist_ok=True)
    summary_path = result_dir / f"{name}.json"
    records_path = result_dir / f"{name}-requests.jsonl"
    summary_path.write_text(json.dumps({**settings, **summary}, indent=2) + "\n", encoding="utf-8")
    with records_path.open("w", encoding="utf-8") as out:
        for record in records:
            out.write(json.dumps({**asdict(record), "tpot": record.tpot}) + "\n")
    return summary_path, records_path
