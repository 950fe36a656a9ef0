"""The serving benchmark client (kvflow.bench): statistics, goodput, SLO parsing, server-sent
event parsing, arrival times, prompt datasets, and whole runs against a small fake OpenAI
streaming server started here."""

import argparse
import asyncio
import json
import math
import statistics

import numpy as np
import pytest
from conftest import running_server
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kvflow.bench import cli as bench_cli
from kvflow.bench import datasets
from kvflow.bench.experiments import free_port
from kvflow.bench.datasets import BenchRequest, jsonl_requests, random_requests
from kvflow.bench.latency_stats import RequestRecord, parse_slo, percentile, summarize
from kvflow.bench.serve_client import (ServerSentEvents, StreamedCompletion, arrival_offsets, run_benchmark,
                                       wait_until_ready)


# ---------------------------------------------------------------- percentiles and summary


def test_percentile_interpolates_between_closest_ranks():
    assert percentile([1, 2, 3, 4], 50) == pytest.approx(2.5)
    assert percentile([1, 2, 3, 4], 99) == pytest.approx(3.97)
    assert percentile([4, 1, 3, 2], 0) == 1
    assert percentile([4, 1, 3, 2], 100) == 4
    assert percentile([7.0], 95) == 7.0


def test_percentile_matches_numpy_default():
    values = np.random.default_rng(3).exponential(size=101).tolist()
    for p in (0, 1, 33.3, 50, 90, 95, 99, 100):
        assert percentile(values, p) == pytest.approx(np.percentile(values, p))


@pytest.mark.parametrize("values, p", [([], 50), ([1.0], -1), ([1.0], 100.5)])
def test_percentile_rejects_empty_lists_and_bad_ranks(values, p):
    with pytest.raises(ValueError):
        percentile(values, p)


def completed(ttft: float, output_len: int, tpot: float = 0.0, itls: list[float] | None = None,
              prompt_len: int = 10) -> RequestRecord:
    """A successful request whose e2e latency follows from its TTFT and TPOT."""
    return RequestRecord(prompt_len=prompt_len, output_len=output_len, success=True, ttft=ttft,
                         itls=itls or [], e2e_latency=ttft + tpot * max(output_len - 1, 0))


def test_tpot_excludes_the_first_token():
    record = RequestRecord(prompt_len=5, output_len=11, success=True, ttft=0.5, e2e_latency=1.5)
    assert record.tpot == pytest.approx(0.1)
    assert RequestRecord(prompt_len=5, output_len=1, success=True, ttft=0.5, e2e_latency=0.5).tpot is None


def test_goodput_counts_requests_meeting_every_slo():
    records = [
        completed(ttft=0.2, output_len=11, tpot=0.03),  # meets both
        completed(ttft=0.4, output_len=1),  # meets TTFT; one token has no TPOT to miss
        completed(ttft=0.8, output_len=11, tpot=0.01),  # TTFT too slow
        completed(ttft=0.1, output_len=5, tpot=0.1),  # TPOT too slow
        RequestRecord(prompt_len=10, error="HTTP 500"),  # failed: never counted
    ]
    summary = summarize(records, duration_s=2.0, slo={"ttft": 0.5, "tpot": 0.05})
    assert summary["completed"] == 4 and summary["failed"] == 1
    assert summary["goodput"] == pytest.approx(1.0)  # 2 good requests in 2 s
    assert summary["slo_attainment"] == pytest.approx(0.5)


def test_itl_slo_bounds_every_gap_of_a_request():
    records = [completed(ttft=0.1, output_len=4, itls=[0.01, 0.05, 0.02]),  # the worst gap is on the bound
               completed(ttft=0.1, output_len=4, itls=[0.01, 0.06, 0.01])]
    summary = summarize(records, duration_s=1.0, slo={"itl": 0.05})
    assert summary["goodput"] == pytest.approx(1.0)
    assert summary["slo_attainment"] == pytest.approx(0.5)


def test_summary_throughput_and_latencies_in_milliseconds():
    records = [completed(ttft=0.1, output_len=3, tpot=0.02, itls=[0.02, 0.02], prompt_len=100),
               completed(ttft=0.2, output_len=5, tpot=0.04, itls=[0.01, 0.03, 0.05, 0.07], prompt_len=50),
               completed(ttft=0.4, output_len=1, prompt_len=30),
               completed(ttft=0.8, output_len=2, tpot=0.1, itls=[0.1], prompt_len=20),
               RequestRecord(prompt_len=1000, output_len=0, success=False, error="timeout", ttft=9.0,
                             e2e_latency=9.0)]
    summary = summarize(records, duration_s=4.0)
    assert summary["completed"] == 4 and summary["failed"] == 1
    assert summary["request_throughput"] == pytest.approx(1.0)
    assert summary["output_throughput"] == pytest.approx((3 + 5 + 1 + 2) / 4)
    assert summary["total_token_throughput"] == pytest.approx((200 + 11) / 4)
    assert summary["mean_ttft_ms"] == pytest.approx(375.0)
    assert summary["p50_ttft_ms"] == pytest.approx(300.0)
    assert summary["std_ttft_ms"] == pytest.approx(np.std([100, 200, 400, 800]))
    # TPOT over the three requests with more than one token: 20, 40 and 100 ms
    assert summary["mean_tpot_ms"] == pytest.approx(160 / 3)
    assert summary["p99_tpot_ms"] == pytest.approx(40 + 0.98 * 60)
    # ITL over every gap of every request
    assert summary["mean_itl_ms"] == pytest.approx(1000 * statistics.fmean([0.02, 0.02, 0.01, 0.03, 0.05, 0.07, 0.1]))
    assert summary["p50_itl_ms"] == pytest.approx(30.0)
    assert summary["mean_e2e_ms"] == pytest.approx((140 + 360 + 400 + 900) / 4)
    assert "goodput" not in summary


def test_summary_of_a_run_where_everything_failed():
    summary = summarize([RequestRecord(prompt_len=5, error="refused")], duration_s=1.0, slo={"ttft": 1.0})
    assert summary["completed"] == 0 and summary["failed"] == 1
    assert summary["request_throughput"] == 0
    assert summary["mean_ttft_ms"] is None and summary["p99_e2e_ms"] is None
    assert summary["goodput"] == 0 and summary["slo_attainment"] is None


def test_parse_slo_reads_units():
    assert parse_slo("ttft=0.5,tpot=0.05") == pytest.approx({"ttft": 0.5, "tpot": 0.05})
    assert parse_slo("ttft=500ms, itl = 20ms,e2e=2s") == pytest.approx({"ttft": 0.5, "itl": 0.02, "e2e": 2.0})


@pytest.mark.parametrize("text, named", [("foo=1", "foo"), ("ttft=abc", "abc"), ("ttft=5xs", "5x"),
                                         ("tpot", "tpot"), ("ttft=-1", "ttft=-1"), ("ttft=1,ttft=2", "twice"),
                                         ("", "no SLO")])
def test_parse_slo_names_the_bad_part(text, named):
    with pytest.raises(ValueError, match=named):
        parse_slo(text)


# ---------------------------------------------------------------- server-sent events


def read_stream(chunks: list[bytes]) -> StreamedCompletion:
    """Feeds `chunks` as if the i-th arrived at time i + 1 (the request started at 0)."""
    events = ServerSentEvents()
    stream = StreamedCompletion(start=0.0)
    for arrival, chunk in enumerate(chunks, start=1):
        for data in events.feed(chunk):
            stream.add_event(data, float(arrival))
    for data in events.close():
        stream.add_event(data, float(len(chunks) + 1))
    return stream


def test_sse_stream_split_across_reads():
    chunks = [b'data: {"choices":[{"text":"Hel',
              b'lo"}]}\n\ndata: {"choices":[{"text":" w',
              b'orld"}]}\n',
              b'\n: a comment\r\ndata: {"choices":[{"text":" caf\xc3',
              b'\xa9"}]}\r\n\r\ndata: {"choices":[],"usage":{"prompt_tokens":4,"completion_tokens":3}}\n\n',
              b"data: [DONE]\n\n"]
    stream = read_stream(chunks)
    assert "".join(stream.text_parts) == "Hello world café"
    assert stream.ttft == 2.0  # "Hello" is complete only with the second read
    assert stream.itls == [2.0, 1.0]  # " world" completes at read 4, " café" at read 5
    assert stream.completion_tokens == 3
    assert stream.done and not stream.error


def test_sse_chat_deltas_and_a_stream_without_final_blank_line():
    chunks = [b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n',
              b'data: {"choices":[{"delta":{"content":"Hi"}}]}\n\n',
              b'data: {"choices":[{"delta":{"content":"!"},"finish_reason":"length"}]}\n\n',
              b"data: [DONE]"]
    stream = read_stream(chunks)
    assert stream.text_parts == ["Hi", "!"]
    assert stream.ttft == 2.0  # the role-only chunk carries no text
    assert stream.itls == [1.0]
    assert stream.completion_tokens is None
    assert stream.done


@pytest.mark.parametrize("event", [b'{"error": {"message": "out of memory", "code": 500}}',
                                   b'{"object": "error", "message": "out of memory"}'])
def test_sse_error_event(event):
    stream = read_stream([b'data: {"choices":[{"text":"a"}]}\n\n', b"data: " + event + b"\n\n"])
    assert stream.error == "out of memory"


# ---------------------------------------------------------------- arrivals


def test_poisson_arrivals_have_the_requested_mean_gap():
    offsets = arrival_offsets(20_000, request_rate=10.0, seed=1)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(0.1, rel=0.03)
    assert gaps.std() == pytest.approx(0.1, rel=0.05)  # exponential: the spread equals the mean
    assert arrival_offsets(50, 10.0, seed=1) == arrival_offsets(50, 10.0, seed=1)
    assert arrival_offsets(50, 10.0, seed=1) != arrival_offsets(50, 10.0, seed=2)


def test_bursty_arrivals_keep_the_mean_and_widen_the_spread():
    gaps = np.diff(arrival_offsets(20_000, request_rate=10.0, burstiness=0.25, seed=1))
    assert gaps.mean() == pytest.approx(0.1, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(2.0, rel=0.1)  # gamma: 1 / sqrt(shape)


def test_infinite_rate_sends_everything_at_once():
    assert arrival_offsets(5, math.inf) == [0.0] * 5
    with pytest.raises(ValueError):
        arrival_offsets(5, 0.0)


# ---------------------------------------------------------------- datasets


class WordTokenizer:
    """One token per whitespace-separated word: enough for what the JSONL dataset and the client
    ask of a tokenizer."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    return datasets.load_tokenizer(None)


def test_random_requests_have_true_prompt_lengths_in_range(smollm2_tokenizer):
    requests = random_requests(smollm2_tokenizer, num=40, input_len=100, output_len=20, range_ratio=0.5, seed=7)
    assert len(requests) == 40
    for request in requests:
        assert request.prompt_len == len(smollm2_tokenizer.encode(request.prompt))
        assert 50 <= request.prompt_len <= 150
        assert 10 <= request.output_len <= 20 * 1.5
    assert len({request.prompt_len for request in requests}) > 10  # the lengths really vary
    again = random_requests(smollm2_tokenizer, num=40, input_len=100, output_len=20, range_ratio=0.5, seed=7)
    assert again == requests


def test_random_requests_without_range_have_the_exact_lengths(smollm2_tokenizer):
    requests = random_requests(smollm2_tokenizer, num=10, input_len=64, output_len=8, seed=0)
    special = smollm2_tokenizer.special_token_ids
    for request in requests:
        ids = smollm2_tokenizer.encode(request.prompt)
        assert len(ids) == request.prompt_len == 64 and request.output_len == 8
        assert not special & set(ids)


def test_jsonl_requests(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "one two three"}\n\n{"prompt": "four", "max_tokens": 7}\n'
                    '{"prompt": "five six", "output_len": 3}\n')
    requests = jsonl_requests(path, WordTokenizer(), num=None, output_len=16)
    assert requests == [BenchRequest("one two three", 3, 16), BenchRequest("four", 1, 7),
                        BenchRequest("five six", 2, 3)]
    assert len(jsonl_requests(path, WordTokenizer(), num=2, output_len=16)) == 2
    with pytest.raises(ValueError, match="3 prompts"):
        jsonl_requests(path, WordTokenizer(), num=5, output_len=16)


@pytest.mark.parametrize("bad_line", ['{"prompt": "x"', '{"text": "x"}', '{"prompt": "x", "max_tokens": 0}'])
def test_jsonl_errors_name_the_line(tmp_path, bad_line):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n\n' + bad_line + "\n")
    with pytest.raises(ValueError, match=r"prompts\.jsonl:3:"):
        jsonl_requests(path, WordTokenizer(), num=None, output_len=16)
    with pytest.raises(FileNotFoundError, match="missing.jsonl"):
        jsonl_requests(tmp_path / "missing.jsonl", WordTokenizer(), num=None, output_len=16)


# ---------------------------------------------------------------- a fake OpenAI server

TOKEN_DELAY_S = 0.02


class FakeOpenAIServer:
    """Streams max_tokens chunks of one word each, TOKEN_DELAY_S apart, then the usage. The
    prompt 'please fail' gets an HTTP 400, a prompt starting 'no usage' a stream without usage,
    'error midway' an error event after one chunk."""

    def __init__(self):
        self.payloads: list[dict] = []
        self.authorizations: list[str | None] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.app = Starlette(routes=[Route("/health", self.health), Route("/v1/models", self.models),
                                     Route("/v1/completions", self.complete, methods=["POST"]),
                                     Route("/v1/chat/completions", self.complete, methods=["POST"])])

    async def health(self, request: Request):
        return JSONResponse({})

    async def models(self, request: Request):
        return JSONResponse({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def complete(self, request: Request):
        payload = await request.json()
        self.payloads.append(payload)
        self.authorizations.append(request.headers.get("authorization"))
        chat = request.url.path.endswith("/chat/completions")
        prompt = payload["messages"][0]["content"] if chat else payload["prompt"]
        if prompt == "please fail":
            return JSONResponse({"error": {"message": "prompt refused"}}, status_code=400)
        return StreamingResponse(self.events(prompt, payload["max_tokens"], chat), media_type="text/event-stream")

    async def events(self, prompt: str, max_tokens: int, chat: bool):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            for index in range(max_tokens):
                await asyncio.sleep(TOKEN_DELAY_S)
                word = f"word{index} "
                choice = {"index": 0, "delta": {"content": word}} if chat else {"index": 0, "text": word}
                yield f"data: {json.dumps({'choices': [choice]})}\n\n"
                if prompt == "error midway":
                    yield 'data: {"error": {"message": "engine died"}}\n\n'
                    return
            if not prompt.startswith("no usage"):
                usage = {"prompt_tokens": len(prompt.split()), "completion_tokens": max_tokens}
                yield f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"
        finally:
            self.in_flight -= 1


@pytest.fixture
def fake_server():
    fake = FakeOpenAIServer()
    with running_server(fake.app) as base_url:
        fake.base_url = base_url
        yield fake


def test_run_benchmark_times_streamed_completions(fake_server):
    requests = [BenchRequest("a b c", 3, 4), BenchRequest("d e", 2, 1), BenchRequest("please fail", 2, 4),
                BenchRequest("no usage here", 3, 3), BenchRequest("error midway", 2, 5)]
    records, duration = asyncio.run(run_benchmark(
        requests, base_url=fake_server.base_url, model="fake-model", api_key="secret",
        tokenizer=WordTokenizer(), show_progress=False))
    assert [record.prompt_len for record in records] == [3, 2, 2, 3, 2]
    assert [record.success for record in records] == [True, True, False, True, False]
    assert [record.output_len for record in records[:2]] == [4, 1]  # from the usage chunk
    assert records[3].output_len == 3  # no usage: the text re-tokenized, one word a token
    assert "400" in records[2].error and "prompt refused" in records[2].error
    assert records[4].error == "engine died"
    for record in (records[0], records[1], records[3]):
        assert TOKEN_DELAY_S * 0.9 <= record.ttft < record.e2e_latency <= duration
        assert len(record.itls) == record.output_len - 1
        assert all(gap >= TOKEN_DELAY_S * 0.5 for gap in record.itls)
        assert record.e2e_latency >= TOKEN_DELAY_S * 0.9 * record.output_len
    sent = fake_server.payloads[0]
    assert sent["stream"] is True and sent["ignore_eos"] is True and sent["temperature"] == 0
    assert sent["stream_options"] == {"include_usage": True} and sent["model"] == "fake-model"
    assert set(fake_server.authorizations) == {"Bearer secret"}


def test_run_benchmark_respects_concurrency_and_arrival_times(fake_server):
    requests = [BenchRequest(f"prompt {index}", 2, 3) for index in range(6)]
    records, _ = asyncio.run(run_benchmark(
        requests, base_url=fake_server.base_url, model="fake-model", max_concurrency=2, request_rate=50.0,
        seed=3, show_progress=False))
    assert all(record.success for record in records)
    assert fake_server.most_in_flight == 2
    for record, offset in zip(records, arrival_offsets(6, 50.0, seed=3)):
        assert record.start_time >= offset - 1e-3  # never sent before its arrival time


def test_run_benchmark_chat_endpoint(fake_server):
    records, _ = asyncio.run(run_benchmark(
        [BenchRequest("hello there", 2, 3)], base_url=fake_server.base_url, model="fake-model",
        endpoint="/v1/chat/completions", ignore_eos=False, show_progress=False))
    assert records[0].success and records[0].output_len == 3 and len(records[0].itls) == 2
    sent = fake_server.payloads[0]
    assert sent["messages"] == [{"role": "user", "content": "hello there"}] and sent["ignore_eos"] is False


def test_wait_until_ready(fake_server):
    wait_until_ready(fake_server.base_url, timeout=5)
    closed_url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(TimeoutError, match="not ready"):
        wait_until_ready(closed_url, timeout=0.3, interval=0.1)


# ---------------------------------------------------------------- command line


def bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvflow")
    bench_cli.add_bench_arguments(parser.add_subparsers(dest="command", required=True))
    return parser


def test_cli_needs_a_bench_subcommand_and_has_defaults(capsys):
    with pytest.raises(SystemExit):
        bench_parser().parse_args(["bench"])
    args = bench_parser().parse_args(["bench", "serve", "--no-ignore-eos"])
    assert args.bench_command == "serve" and math.isinf(args.request_rate)
    assert args.base_url == "http://127.0.0.1:8000" and args.ignore_eos is False and args.tokenizer is None


def test_cli_serve_end_to_end(fake_server, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(datasets, "load_tokenizer", lambda model: WordTokenizer())
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"p {index}", "max_tokens": 3}) + "\n" for index in range(4)))
    result_dir = tmp_path / "results"
    args = bench_parser().parse_args([
        "bench", "serve", "--base-url", fake_server.base_url, "--dataset", "jsonl", "--dataset-path", str(prompts),
        "--max-concurrency", "2", "--slo", "ttft=10s,tpot=10s", "--result-dir", str(result_dir), "--plot",
        "--no-progress"])
    assert bench_cli.run_bench(args) == 0
    assert "Serving Benchmark Result" in capsys.readouterr().out
    assert fake_server.payloads[0]["model"] == "fake-model"  # asked of GET /v1/models
    [summary_path] = result_dir.glob("*.json")
    summary = json.loads(summary_path.read_text())
    assert summary["completed"] == 4 and summary["failed"] == 0 and summary["num_prompts"] == 4
    assert summary["total_output_tokens"] == 12 and summary["slo_attainment"] == 1.0
    assert summary["request_rate"] == "inf" and summary["max_concurrency"] == 2
    [records_path] = result_dir.glob("*-requests.jsonl")
    lines = [json.loads(line) for line in records_path.read_text().splitlines()]
    assert [line["output_len"] for line in lines] == [3] * 4 and all(line["tpot"] > 0 for line in lines)
    [plot_path] = result_dir.glob("*.png")
    assert plot_path.read_bytes().startswith(b"\x89PNG")


def test_plot_concurrency_sweep(tmp_path):
    from kvflow.bench.plots import plot_concurrency_sweep

    rows = [{"concurrency": 4, "output_throughput": 300.0, "p99_tpot_ms": 30.0, "p50_tpot_ms": 20.0},
            {"concurrency": 1, "output_throughput": 100.0, "p99_tpot_ms": 12.0, "p50_tpot_ms": 10.0}]
    path = plot_concurrency_sweep(rows, tmp_path / "sweep.png")
    assert path.read_bytes().startswith(b"\x89PNG")
