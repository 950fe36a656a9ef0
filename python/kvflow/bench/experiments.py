"""`python -m kvflow bench experiments --out DIR`: the four latency experiments, one command.

1. Prompt length swept, output fixed, one request at a time -> TTFT (prefill is compute-bound).
2. Prompt fixed, output length swept, one request at a time -> E2E, with the least-squares fit
   E2E = a + b (N - 1), whose a should match the TTFT and b the TPOT.
3. Concurrency swept -> output throughput, P50/P99 TPOT and goodput under an SLO.
4. Hugging Face transformers one request at a time against kvflow's continuous batching, on the
   same requests arriving together.

Experiments 1-3 go through the OpenAI HTTP API of a kvflow server this command starts (or the one
at --base-url); experiment 4 runs transformers in this process after that server has stopped, so
that the two never share the CPU. Writes report.md, results.json and PNG plots into DIR."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvflow.bench import latency_stats
from kvflow.bench.datasets import BenchRequest, load_tokenizer, random_requests
from kvflow.bench.latency_stats import RequestRecord, percentile, summarize
from kvflow.bench.serve_client import fetch_model_id, run_benchmark, wait_until_ready
from kvflow.engine.distributed.rank_group import free_port


@dataclass
class Plan:
    prompt_lens: tuple[int, ...] = (16, 64, 256, 1024, 2048)
    prompt_sweep_output_len: int = 16
    prompt_sweep_repeats: int = 5
    output_lens: tuple[int, ...] = (16, 64, 128, 256, 512)
    output_sweep_prompt_len: int = 128
    output_sweep_repeats: int = 3
    concurrencies: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    concurrency_prompt_len: int = 144          # uniform in [32, 256]
    concurrency_range_ratio: float = 0.78
    concurrency_output_len: int = 128
    hf_requests: int = 16
    hf_output_len: int = 64


# The quick plan's output lengths lie far enough apart that their 64 decode tokens outweigh the
# jitter of a prefill, so that the fitted TPOT is a slope and not noise.
QUICK_PLAN = Plan(prompt_lens=(16, 128), prompt_sweep_repeats=2, output_lens=(8, 72), output_sweep_repeats=2,
                  concurrencies=(1, 4), concurrency_output_len=16, hf_requests=4, hf_output_len=8)


def _engine_flags(args) -> list[str]:
    """The shared engine arguments, passed on to `python -m kvflow serve`."""
    flags = ["--device", args.device, "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--block-size", str(args.block_size),
             "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    for name in ("model", "dtype", "max_model_len", "kv_cache_memory", "threads", "seed"):
        if getattr(args, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if not args.enable_prefix_caching:
        flags.append("--no-enable-prefix-caching")
    if args.enforce_eager:
        flags.append("--enforce-eager")
    if args.dequantize_weights:
        flags.append("--dequantize-weights")
    if args.speculative_config:
        flags += ["--speculative-config", args.speculative_config]
    if args.batch_invariant:
        flags.append("--batch-invariant")
    if args.num_scheduler_steps != 1:
        flags += ["--num-scheduler-steps", str(args.num_scheduler_steps)]
    if args.tensor_parallel_size != 1:
        flags += ["--tensor-parallel-size", str(args.tensor_parallel_size),
                  "--tensor-parallel-timeout", str(args.tensor_parallel_timeout)]
    return flags


class _Server:
    """A kvflow server in a child process, stopped with SIGTERM."""

    def __init__(self, args, log_path: Path):
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "kvflow", "serve", "--port", str(self.port), "--uvicorn-log-level", "warning",
             *_engine_flags(args)], stdout=self._log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while self.process.poll() is None and time.monotonic() < deadline:
            try:
                wait_until_ready(self.base_url, timeout=1)
                return
            except TimeoutError:
                pass
        raise RuntimeError(f"the kvflow server did not start (see {self._log.name})")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()


def _bench(requests: list[BenchRequest], base_url: str, model: str, concurrency: int | None,
           api_key: str | None) -> tuple[list[RequestRecord], float]:
    return asyncio.run(run_benchmark(requests, base_url=base_url, model=model, max_concurrency=concurrency,
                                     api_key=api_key, show_progress=False))


def _ms(values: list[float], p: float) -> float:
    return percentile(values, p) * 1000


def _check(records: list[RequestRecord], what: str) -> list[RequestRecord]:
    failed = [r for r in records if not r.success]
    if failed:
        raise RuntimeError(f"{what}: {len(failed)} of {len(records)} requests failed, e.g. {failed[0].error}")
    return records


# ------------------------------------------------------------------ the experiments


def prompt_length_sweep(plan: Plan, tokenizer, base_url: str, model: str, api_key: str | None) -> list[dict]:
    rows = []
    for prompt_len in plan.prompt_lens:
        requests = random_requests(tokenizer, plan.prompt_sweep_repeats, prompt_len, plan.prompt_sweep_output_len,
                                   0.0, seed=prompt_len)
        records = _check(_bench(requests, base_url, model, 1, api_key)[0], f"prompt length {prompt_len}")
        ttfts = [r.ttft for r in records]
        lens = [r.prompt_len for r in records]
        rows.append({"prompt_len": prompt_len, "requests": len(records), "prompt_len_min": min(lens),
                     "prompt_len_max": max(lens), "p50_ttft_ms": _ms(ttfts, 50), "p95_ttft_ms": _ms(ttfts, 95),
                     "p99_ttft_ms": _ms(ttfts, 99), "prefill_tokens_per_s": sum(lens) / sum(ttfts)})
        print(f"  prompt {prompt_len:5d}: TTFT p50 {rows[-1]['p50_ttft_ms']:.1f} ms", file=sys.stderr)
    return rows


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares intercept and slope of y = a + b x."""
    n, mean_x, mean_y = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mean_x) ** 2 for x in xs)
    if n < 2 or spread == 0:
        raise ValueError("a line needs at least two distinct x values")
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / spread
    return mean_y - slope * mean_x, slope


def output_length_sweep(plan: Plan, tokenizer, base_url: str, model: str, api_key: str | None) -> dict:
    rows, points = [], []
    all_records = []
    for output_len in plan.output_lens:
        requests = random_requests(tokenizer, plan.output_sweep_repeats, plan.output_sweep_prompt_len, output_len,
                                   0.0, seed=output_len)
        records = _check(_bench(requests, base_url, model, 1, api_key)[0], f"output length {output_len}")
        all_records += records
        e2es = [r.e2e_latency for r in records]
        rows.append({"output_len": output_len, "requests": len(records),
                     "output_len_min": min(r.output_len for r in records),
                     "output_len_max": max(r.output_len for r in records),
                     "p50_e2e_ms": _ms(e2es, 50), "p95_e2e_ms": _ms(e2es, 95), "p99_e2e_ms": _ms(e2es, 99),
                     "mean_ttft_ms": 1000 * sum(r.ttft for r in records) / len(records),
                     "mean_tpot_ms": 1000 * sum(r.tpot for r in records if r.tpot is not None) / len(records)})
        points += [(r.output_len - 1, r.e2e_latency) for r in records]
        print(f"  output {output_len:4d}: E2E p50 {rows[-1]['p50_e2e_ms']:.0f} ms", file=sys.stderr)
    intercept, slope = fit_line([x for x, _ in points], [y for _, y in points])
    tpots = [r.tpot for r in all_records if r.tpot is not None]
    return {"rows": rows, "points": points, "fit_ttft_ms": intercept * 1000, "fit_tpot_ms": slope * 1000,
            "measured_ttft_ms": 1000 * sum(r.ttft for r in all_records) / len(all_records),
            "measured_tpot_ms": 1000 * sum(tpots) / len(tpots)}


def concurrency_sweep(plan: Plan, tokenizer, base_url: str, model: str, api_key: str | None,
                      slo: dict[str, float]) -> tuple[list[dict], dict[int, list[RequestRecord]]]:
    rows, records_by_concurrency = [], {}
    for concurrency in plan.concurrencies:
        num = max(8, 2 * concurrency)
        requests = random_requests(tokenizer, num, plan.concurrency_prompt_len, plan.concurrency_output_len,
                                   plan.concurrency_range_ratio, seed=concurrency)
        requests = [BenchRequest(r.prompt, r.prompt_len, plan.concurrency_output_len) for r in requests]
        records, duration = _bench(requests, base_url, model, concurrency, api_key)
        records_by_concurrency[concurrency] = _check(records, f"concurrency {concurrency}")
        summary = summarize(records, duration, slo)
        lens = [r.prompt_len for r in records]
        rows.append({"concurrency": concurrency, "requests": num, "prompt_len_min": min(lens),
                     "prompt_len_mean": sum(lens) / len(lens), "prompt_len_max": max(lens), **summary})
        print(f"  concurrency {concurrency:3d}: {summary['output_throughput']:.0f} tokens/s, TPOT p99 "
              f"{summary['p99_tpot_ms']:.1f} ms, goodput {summary['goodput']:.2f} req/s", file=sys.stderr)
    return rows, records_by_concurrency


def hf_one_at_a_time(requests: list[BenchRequest], model_path: str | None, dtype: str, device: str) -> dict:
    """Hugging Face transformers, greedy, one request after another as if they all arrived at
    time 0: a request's TTFT and E2E include the wait for the ones before it."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    from kvflow.loader import resolve_model_path

    path = resolve_model_path(model_path)
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    if os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                     dtype=torch_dtype).eval()
    model.to(device)
    tokenizer = load_tokenizer(model_path)

    class TokenTimes(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    records, start = [], time.perf_counter()
    with torch.inference_mode():
        for request in requests:
            ids = tokenizer.encode(request.prompt)
            streamer = TokenTimes()
            model.generate(torch.tensor([ids], device=device),
                           attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                           max_new_tokens=request.output_len, min_new_tokens=request.output_len, do_sample=False,
                           streamer=streamer)
            token_times = streamer.times[1:]  # the first put is the prompt
            records.append(RequestRecord(len(ids), len(token_times), True, "", 0.0, token_times[0] - start,
                                         [b - a for a, b in zip(token_times, token_times[1:])],
                                         token_times[-1] - start))
    return summarize(records, time.perf_counter() - start) | {"dtype": dtype, "device": device}


def kvflow_all_at_once(requests: list[BenchRequest], base_url: str, model: str, api_key: str | None) -> dict:
    records, duration = _bench(requests, base_url, model, None, api_key)
    return summarize(_check(records, "kvflow, all at once"), duration)


# ------------------------------------------------------------------ report


def _table(headers: list[str], rows: list[list]) -> list[str]:
    def cell(value):
        if isinstance(value, float):
            return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"
        return str(value)

    return ["| " + " | ".join(headers) + " |", "|" + "---:|" * len(headers)] + \
        ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]


def _triple(summary: dict, metric: str) -> str:
    return "/".join(f"{summary[f'p{p}_{metric}_ms']:.1f}" for p in (50, 95, 99))


def write_report(out: Path, results: dict) -> Path:
    lines = ["# kvflow latency experiments", "",
             f"{results['date']}; model `{results['model']}`, {results['dtype']}, server {results['server']}; "
             f"torch {results['torch']}, {results['cpu_count']} CPUs. Reproduce with `{results['command']}`.", ""]
    e1 = results["prompt_sweep"]
    lines += ["## 1. TTFT against prompt length", "",
              f"Output {results['plan']['prompt_sweep_output_len']} tokens, one request at a time, "
              f"{results['plan']['prompt_sweep_repeats']} requests per length.", ""]
    lines += _table(["prompt tokens (min-max)", "TTFT P50 ms", "P95 ms", "P99 ms", "prefill tokens/s"],
                    [[f"{r['prompt_len_min']}-{r['prompt_len_max']}", r["p50_ttft_ms"], r["p95_ttft_ms"],
                      r["p99_ttft_ms"], r["prefill_tokens_per_s"]] for r in e1])
    lines += ["", "![TTFT vs prompt length](exp1_ttft_vs_prompt.png)", ""]
    e2 = results["output_sweep"]
    lines += ["## 2. E2E against output length", "",
              f"Prompt {results['plan']['output_sweep_prompt_len']} tokens, one request at a time.", ""]
    lines += _table(["output tokens", "E2E P50 ms", "P95 ms", "P99 ms", "mean TTFT ms", "mean TPOT ms"],
                    [[r["output_len"], r["p50_e2e_ms"], r["p95_e2e_ms"], r["p99_e2e_ms"], r["mean_ttft_ms"],
                      r["mean_tpot_ms"]] for r in e2["rows"]])
    lines += ["", f"Least-squares fit E2E = a + b (N - 1): a = {e2['fit_ttft_ms']:.1f} ms (measured mean TTFT "
                  f"{e2['measured_ttft_ms']:.1f} ms), b = {e2['fit_tpot_ms']:.2f} ms (measured mean TPOT "
                  f"{e2['measured_tpot_ms']:.2f} ms). Each request's own E2E is exactly its TTFT + (N - 1) x its "
                  "TPOT; the fit differs from the means where TPOT grows with N (every token attends over a "
                  "longer context), which steepens the slope and lowers the intercept.", "",
              "![E2E vs output length](exp2_e2e_vs_output.png)", ""]
    e3 = results["concurrency_sweep"]
    slo = ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in results["slo"].items())
    lines += ["## 3. Concurrency", "",
              f"Prompts uniform in [{e3[0]['prompt_len_min']}, {max(r['prompt_len_max'] for r in e3)}] tokens "
              f"(per-run ranges below), {results['plan']['concurrency_output_len']} output tokens, 2 x concurrency "
              f"requests (at least 8) at once, the client holding at most `concurrency` in flight. "
              f"Goodput: requests per second meeting {slo}.", ""]
    lines += _table(["concurrency", "prompt tokens min/mean/max", "output tokens/s", "TPOT P50/P95/P99 ms",
                     "TTFT P50/P95/P99 ms", "E2E P50/P99 ms", "goodput req/s"],
                    [[r["concurrency"], f"{r['prompt_len_min']}/{r['prompt_len_mean']:.0f}/{r['prompt_len_max']}",
                      r["output_throughput"], _triple(r, "tpot"), _triple(r, "ttft"),
                      f"{r['p50_e2e_ms']:.0f}/{r['p99_e2e_ms']:.0f}", r["goodput"]] for r in e3])
    lines += ["", "![throughput and TPOT vs concurrency](exp3_concurrency.png)", "",
              "![latency CDFs at the highest concurrency](exp3_latency_cdfs.png)", ""]
    e4 = results["hf_vs_kvflow"]
    lines += ["## 4. Hugging Face one at a time vs kvflow continuous batching", ""]
    if "skipped" in e4:
        lines += [f"Not run: {e4['skipped']}", ""]
    else:
        kv, hf = e4["kvflow"], e4["hf"]
        lines += [f"The same {e4['requests']} requests (prompts {e4['prompt_len_min']}-{e4['prompt_len_max']} tokens, "
                  f"{e4['output_len']} output tokens, greedy), all arriving at once. HF transformers "
                  f"({hf['dtype']}, {hf['device']}) serves them one after another; kvflow ({results['dtype']}) "
                  "batches them.", ""]
        lines += _table(["engine", "output tokens/s", "TTFT P50/P95/P99 ms", "E2E P50/P95/P99 ms",
                         "TPOT P50/P95/P99 ms"],
                        [[name, r["output_throughput"], _triple(r, "ttft"), _triple(r, "e2e"), _triple(r, "tpot")]
                         for name, r in (("HF one at a time", hf), ("kvflow", kv))])
        lines += ["", f"kvflow's output throughput is {kv['output_throughput'] / hf['output_throughput']:.1f}x HF's; "
                      f"its P99 E2E is {hf['p99_e2e_ms'] / kv['p99_e2e_ms']:.1f}x shorter.", ""]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def write_plots(out: Path, results: dict, records_by_concurrency: dict[int, list[RequestRecord]]) -> None:
    from kvflow.bench.plots import plot_concurrency_sweep, plot_e2e_fit, plot_latency_cdfs, plot_ttft_vs_prompt

    plot_ttft_vs_prompt(results["prompt_sweep"], out / "exp1_ttft_vs_prompt.png")
    e2 = results["output_sweep"]
    plot_e2e_fit(e2["points"], e2["fit_ttft_ms"], e2["fit_tpot_ms"], out / "exp2_e2e_vs_output.png")
    plot_concurrency_sweep(results["concurrency_sweep"], out / "exp3_concurrency.png")
    plot_latency_cdfs(records_by_concurrency[max(records_by_concurrency)], out / "exp3_latency_cdfs.png")


def run_experiments(args) -> int:
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plan = QUICK_PLAN if args.quick else Plan()
    slo = latency_stats.parse_slo(args.slo)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    server = None
    if args.base_url is None:
        server = _Server(args, out / "server.log")
        print(f"starting a kvflow server on {server.base_url} (log: {out / 'server.log'}) ...", file=sys.stderr)
        server.wait_ready()
        base_url = server.base_url
    else:
        base_url = args.base_url
    hf_requests = random_requests(tokenizer, plan.hf_requests, 144, plan.hf_output_len, 0.78, seed=4)
    hf_requests = [BenchRequest(r.prompt, r.prompt_len, plan.hf_output_len) for r in hf_requests]
    try:
        model = fetch_model_id(base_url, api_key)
        _bench(random_requests(tokenizer, 2, 32, 4, 0.0, seed=99), base_url, model, None, api_key)  # warm-up
        print("1/4 prompt length sweep", file=sys.stderr)
        prompt_sweep = prompt_length_sweep(plan, tokenizer, base_url, model, api_key)
        print("2/4 output length sweep", file=sys.stderr)
        output_sweep = output_length_sweep(plan, tokenizer, base_url, model, api_key)
        print("3/4 concurrency sweep", file=sys.stderr)
        concurrency_rows, records_by_concurrency = concurrency_sweep(plan, tokenizer, base_url, model, api_key, slo)
        print("4/4 HF one at a time vs kvflow", file=sys.stderr)
        kvflow_batch = kvflow_all_at_once(hf_requests, base_url, model, api_key)
    finally:
        if server is not None:
            server.stop()
    hf_vs_kvflow = {"requests": len(hf_requests), "output_len": plan.hf_output_len,
                    "prompt_len_min": min(r.prompt_len for r in hf_requests),
                    "prompt_len_max": max(r.prompt_len for r in hf_requests), "kvflow": kvflow_batch}
    if args.no_hf:
        hf_vs_kvflow["skipped"] = "--no-hf"
    else:
        try:
            hf_vs_kvflow["hf"] = hf_one_at_a_time(hf_requests, args.model, args.hf_dtype, args.device)
        except ImportError as error:
            hf_vs_kvflow["skipped"] = f"transformers is not installed ({error}); pip install 'kvflow[bench]'"
        except Exception as error:  # the other experiments' results are kept
            hf_vs_kvflow["skipped"] = f"Hugging Face transformers failed: {type(error).__name__}: {error}"
    results = {"date": time.strftime("%Y-%m-%d %H:%M"), "model": model, "dtype": args.dtype or "default",
               "server": "started by this command" if server else base_url, "torch": torch.__version__,
               "cpu_count": os.cpu_count(), "command": "python -m kvflow " + " ".join(sys.argv[1:]),
               "plan": asdict(plan), "slo": slo, "prompt_sweep": prompt_sweep, "output_sweep": output_sweep,
               "concurrency_sweep": concurrency_rows, "hf_vs_kvflow": hf_vs_kvflow}
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n", encoding="utf-8")
    write_plots(out, results, records_by_concurrency)
    report = write_report(out, results)
    print(f"wrote {report}", file=sys.stderr)
    print(report.read_text(encoding="utf-8"))
    return 0
