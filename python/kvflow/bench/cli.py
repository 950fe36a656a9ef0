"""`python -m kvflow bench serve`: the command line of the serving benchmark."""

import argparse
import asyncio
import math
import os
import sys
from datetime import datetime


def add_bench_arguments(subparsers) -> None:
    """Adds the `bench` command, with its `serve` subcommand, to the main parser's subparsers."""
    bench = subparsers.add_parser("bench", help="benchmark a running server")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    serve = bench_commands.add_parser(
        "serve", help="load an OpenAI-compatible server with streamed requests and report latency and throughput")
    add_serve_arguments(serve)
    experiments = bench_commands.add_parser(
        "experiments", help="the four latency experiments (TTFT vs prompt, E2E vs output, concurrency, HF vs kvflow) "
                            "with a markdown report and plots")
    add_experiments_arguments(experiments)


def add_experiments_arguments(parser: argparse.ArgumentParser) -> None:
    from kvflow.entrypoints.cli import add_engine_arguments

    parser.add_argument("--out", required=True, help="directory for report.md, results.json and the PNG plots")
    parser.add_argument("--base-url", default=None,
                        help="benchmark this running server instead of starting a kvflow server with the engine flags")
    parser.add_argument("--api-key", default=None, help="sent as a bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--tokenizer", default=None, help="builds and counts the prompts (default: --model's)")
    parser.add_argument("--slo", default="ttft=1s,tpot=50ms", help="the SLO of experiment 3's goodput")
    parser.add_argument("--quick", action="store_true", help="a few small requests per experiment (a smoke run)")
    parser.add_argument("--no-hf", action="store_true", help="leave out Hugging Face transformers in experiment 4")
    parser.add_argument("--hf-dtype", default="float32", choices=["float32", "bfloat16"],
                        help="Hugging Face's dtype in experiment 4 (float32 is its faster path on CPUs)")
    add_engine_arguments(parser)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server, without /v1")
    parser.add_argument("--endpoint", default="/v1/completions", choices=["/v1/completions", "/v1/chat/completions"])
    parser.add_argument("--model", default=None,
                        help="the model name sent in requests (default: the first one GET /v1/models lists)")
    parser.add_argument("--tokenizer", default=None,
                        help="a GGUF file or Hugging Face directory whose tokenizer builds and counts the prompts "
                             "(default: the embedded default model's)")
    parser.add_argument("--dataset", choices=["random", "jsonl"], default="random")
    parser.add_argument("--dataset-path", default=None,
                        help="with --dataset jsonl: one {\"prompt\": ..., \"output_len\": ...} object a line")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="requests to send (default: 1000 random ones, or every line of the JSONL file)")
    parser.add_argument("--random-input-len", type=int, default=1024, help="prompt tokens (random dataset)")
    parser.add_argument("--random-output-len", type=int, default=128,
                        help="max_tokens of each request (random dataset; the default for JSONL lines without one)")
    parser.add_argument("--random-range-ratio", type=float, default=0.0,
                        help="lengths are drawn uniformly from len * [1 - ratio, 1 + ratio]")
    parser.add_argument("--request-rate", type=float, default=math.inf,
                        help="requests per second (default inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="shape of the gamma-distributed arrival gaps: 1 = Poisson, below 1 burstier")
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--seed", type=int, default=0, help="fixes the prompts and the arrival times")
    parser.add_argument("--slo", default=None,
                        help="service-level objectives for the goodput, e.g. ttft=500ms,tpot=50ms (also itl, e2e)")
    parser.add_argument("--result-dir", default=None,
                        help="write the summary (JSON) and the per-request records (JSONL) here")
    parser.add_argument("--plot", action="store_true", help="also write the latency CDFs as a PNG (needs --result-dir)")
    parser.add_argument("--api-key", default=None, help="sent as a bearer token (default: $OPENAI_API_KEY)")
    parser.add_argument("--ready-timeout", type=float, default=0.0,
                        help="wait up to this many seconds for the server to answer before starting")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                        help="ask the server to generate all max_tokens past end tokens")


def run_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        return run_serve_benchmark(args)
    if args.bench_command == "experiments":
        from kvflow.bench.experiments import run_experiments

        return run_experiments(args)
    raise ValueError(f"unknown bench command {args.bench_command!r}")


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def run_serve_benchmark(args: argparse.Namespace) -> int:
    from kvflow.bench import datasets, latency_stats, serve_client

    if args.plot and args.result_dir is None:
        return _fail("--plot writes into --result-dir; give one")
    if args.dataset == "jsonl" and args.dataset_path is None:
        return _fail("--dataset jsonl needs --dataset-path")
    try:
        slo = latency_stats.parse_slo(args.slo) if args.slo else None
    except ValueError as error:
        return _fail(f"--slo: {error}")
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")

    if args.ready_timeout > 0:
        serve_client.wait_until_ready(args.base_url, args.ready_timeout)
    model = args.model or serve_client.fetch_model_id(args.base_url, api_key)
    tokenizer = datasets.load_tokenizer(args.tokenizer)
    if args.dataset == "random":
        requests = datasets.random_requests(
            tokenizer, args.num_prompts or 1000, args.random_input_len, args.random_output_len,
            args.random_range_ratio, args.seed)
    else:
        requests = datasets.jsonl_requests(args.dataset_path, tokenizer, args.num_prompts, args.random_output_len)

    print(f"{len(requests)} requests to {args.base_url}{args.endpoint} (model {model}), "
          f"rate {args.request_rate:g}/s, burstiness {args.burstiness:g}, "
          f"max concurrency {args.max_concurrency or 'unlimited'}", file=sys.stderr)
    spec_before = serve_client.fetch_spec_decode_counters(args.base_url, api_key)
    records, duration = asyncio.run(serve_client.run_benchmark(
        requests, base_url=args.base_url, model=model, endpoint=args.endpoint, request_rate=args.request_rate,
        burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed,
        ignore_eos=args.ignore_eos, api_key=api_key, tokenizer=tokenizer, show_progress=not args.no_progress))
    summary = latency_stats.summarize(records, duration, slo)
    spec = serve_client.spec_decode_summary(spec_before,
                                            serve_client.fetch_spec_decode_counters(args.base_url, api_key))
    if spec is not None:
        summary["spec_decode"] = spec
    print(serve_client.format_summary(summary))

    errors = sorted({record.error for record in records if not record.success})
    for error in errors[:5]:
        print(f"failed request: {error}", file=sys.stderr)

    if args.result_dir is not None:
        name = f"bench-serve-{datetime.now():%Y%m%d-%H%M%S}"
        settings = {
            "date": datetime.now().isoformat(timespec="seconds"),
            "base_url": args.base_url,
            "endpoint": args.endpoint,
            "model": model,
            "dataset": args.dataset,
            "num_prompts": len(requests),
            "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
            "burstiness": args.burstiness,
            "max_concurrency": args.max_concurrency,
            "random_input_len": args.random_input_len,
            "random_output_len": args.random_output_len,
            "random_range_ratio": args.random_range_ratio,
            "ignore_eos": args.ignore_eos,
            "seed": args.seed,
            "slo": slo,
        }
        paths = serve_client.write_results(args.result_dir, name, summary, settings, records)
        if args.plot:
            from kvflow.bench.plots import plot_latency_cdfs

            paths += (plot_latency_cdfs(records, os.path.join(args.result_dir, f"{name}-latency-cdf.png")),)
        print("wrote " + ", ".join(str(path) for path in paths), file=sys.stderr)
    return 0 if summary["completed"] > 0 else 1
