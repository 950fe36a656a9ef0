"""What the HTTP layer costs: the same requests through the offline engine (kvflow.LLM with
max_num_seqs=C) and through `python -m kvflow serve --max-num-seqs C` driven by the serving
benchmark client at concurrency C, output tokens/s of each and their ratio, in one run.

    python benchmarks/bench_serving_overhead.py                  # 64 requests, concurrency 16
    python benchmarks/bench_serving_overhead.py --requests 32 --concurrency 8
"""

import argparse
import asyncio
import gc
import subprocess
import sys
import time

from kvflow import LLM, SamplingParams
from kvflow.bench.datasets import random_requests
from kvflow.bench.experiments import free_port
from kvflow.bench.latency_stats import summarize
from kvflow.bench.serve_client import run_benchmark, wait_until_ready
from timing import write_markdown


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()

    # A step per schedule, as the server runs: what separates the two is then the HTTP path.
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.concurrency, num_scheduler_steps=1)
    requests = random_requests(llm.tokenizer, args.requests, 144, args.output_len, 0.78, seed=0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate([r.prompt for r in requests[:2]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate([r.prompt for r in requests], params, use_tqdm=False)
    offline = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
    del llm, outputs
    gc.collect()

    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "kvflow", "serve", "--port", str(port), "--dtype", args.dtype,
                               "--max-num-seqs", str(args.concurrency), "--uvicorn-log-level", "warning"]
                              + (["--model", args.model] if args.model else []),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_ready(url, timeout=300)
        asyncio.run(run_benchmark(requests[:2], base_url=url, model=None, show_progress=False))  # warm-up
        records, duration = asyncio.run(run_benchmark(requests, base_url=url, model=None,
                                                      max_concurrency=args.concurrency, show_progress=False))
    finally:
        server.terminate()
        server.wait()
    summary = summarize(records, duration)
    served = summary["output_throughput"]
    lines = [f"{args.requests} requests, prompts {min(r.prompt_len for r in requests)}-"
             f"{max(r.prompt_len for r in requests)} tokens, {args.output_len} output tokens each, {args.dtype}, "
             f"concurrency {args.concurrency}",
             "",
             "| path | output tokens/s |",
             "|---|---:|",
             f"| offline engine (max_num_seqs={args.concurrency}) | {offline:.1f} |",
             f"| HTTP server + streaming client (concurrency {args.concurrency}) | {served:.1f} |",
             "",
             f"server / offline = {served / offline:.2f} (failed requests: {summary['failed']}); server TPOT "
             f"p50 {summary['p50_tpot_ms']:.1f} ms, p99 {summary['p99_tpot_ms']:.1f} ms"]
    print("\n".join(lines))
    write_markdown(args.markdown, lines)


if __name__ == "__main__":
    main()
