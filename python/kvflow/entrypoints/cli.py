"""The command line. Only completions go to stdout, so that they can be piped; progress and
timings go to stderr."""

import argparse
import sys

from kvflow.engine.config import DTYPES
from kvflow.entrypoints.openai.limits import DEFAULT_MAX_PROMPTS_PER_REQUEST, DEFAULT_MAX_REQUEST_BYTES
from kvflow.entrypoints.openai.tool_calls import TOOL_CALL_FORMATS


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def parse_memory(text: str) -> int:
    """'2GiB', '512MiB', '1e9' -> bytes."""
    units = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    lowered = text.strip().lower()
    for suffix, scale in units.items():
        if lowered.endswith(suffix):
            return int(float(lowered[: -len(suffix)]) * scale)
    return int(float(lowered))


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine configuration every entry point shares, under vLLM's names."""
    parser.add_argument("--model", default=None,
                        help="a GGUF file, a Hugging Face directory (config.json + safetensors), or the name of the "
                             "embedded default SmolLM2-135M-Instruct (the default)")
    parser.add_argument("--dtype", choices=list(DTYPES), default=None,
                        help="weights and activations (default: bfloat16, or float32 on a CPU without AVX2; "
                             "GGUF weights of quantized types kvflow has no kernels for are dequantized to it)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:N]")
    parser.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    parser.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="new tokens per model step")
    parser.add_argument("--kv-cache-memory", type=parse_memory, default=None,
                        help="KV cache size, e.g. 2GiB (default: 1GiB on the CPU; on CUDA what "
                             "--gpu-memory-utilization leaves after the weights and activations)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="CUDA: the share of the GPU's memory the engine may use")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run decode steps op by op instead of replaying a CUDA graph (CUDA) or a captured "
                        "program in one parallel region (CPU)")
    parser.add_argument("--dequantize-weights", action="store_true",
                        help="load a GGUF file's Q4_0/Q4_1/Q8_0 weights in --dtype instead of keeping them in "
                        "their blocks (more memory, slower decode)")
    parser.add_argument("--speculative-config", default=None,
                        help='speculative decoding as JSON, vLLM\'s spelling: \'{"method": "ngram", '
                        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}\'')
    parser.add_argument("--batch-invariant", action="store_true",
                        help="CPU: every row's logits bit-equal whatever the batch (slower; process-wide)")
    parser.add_argument("--num-scheduler-steps", type=positive_int, default=1,
                        help="CPU: decode steps run back to back per schedule while every request decodes and "
                        "none waits (outputs then come that many tokens at a time)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="reuse the KV blocks of shared prompt prefixes")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (per rank with tensor parallelism)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="split the model over this many processes (under torchrun: its ranks; otherwise "
                        "spawned on this machine, the cores shared out)")
    parser.add_argument("--tensor-parallel-timeout", type=float, default=60.0,
                        help="seconds a rank waits for the others within a step before the engine stops")
    parser.add_argument("--seed", type=int, default=None, help="fixes the random draws")


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--min-p", type=float, default=0.0, help="0 = off")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="1 = off")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past end tokens")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m kvflow", description="kvflow: an LLM inference engine")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="stream the completion of a prompt to stdout")
    generate.add_argument("prompt", nargs="?", default=None,
                          help="the prompt text; special tokens written in it (e.g. <|im_start|>) are read as "
                               "special tokens")
    generate.add_argument("--prompts-file", default=None,
                          help="a file with one prompt per line, all run together (batched); completions are "
                               "printed in order, one block each")
    generate.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    generate.add_argument("--system", default=None, help="a system message (with --chat)")
    generate.add_argument("--quiet", action="store_true", help="no progress or timings on stderr")
    add_engine_arguments(generate)
    add_sampling_arguments(generate)

    chat = commands.add_parser("chat", help="an interactive conversation in the terminal")
    chat.add_argument("--system", default=None, help="a system message")
    add_engine_arguments(chat)
    add_sampling_arguments(chat)

    serve = commands.add_parser("serve", help="an OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1", help="the address to bind (loopback unless told otherwise)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    serve.add_argument("--api-key", default=None,
                       help="require `Authorization: Bearer KEY` on every /v1 route (or set KVFLOW_API_KEY)")
    serve.add_argument("--max-queue-len", type=positive_int, default=None,
                       help="waiting samples (prompts x n) beyond which new requests get 503 (default: unbounded)")
    serve.add_argument("--max-request-bytes", type=parse_memory, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="largest request body accepted, e.g. 8MiB (the default); larger ones get 413")
    serve.add_argument("--max-prompts-per-request", type=positive_int, default=DEFAULT_MAX_PROMPTS_PER_REQUEST,
                       help="prompts one completion request may carry (default: %(default)s)")
    serve.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_FORMATS), default="hermes",
                       help="the format the model writes tool calls in, where its chat template renders tools "
                            "(a template without tools gets kvflow's Hermes prompt and format)")
    serve.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds requests in flight may take to finish at shutdown before they are aborted")
    serve.add_argument("--uvicorn-log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(serve)

    commands.add_parser("env", help="what this machine is and what kvflow will run on it (for bug reports)")

    from kvflow.bench.cli import add_bench_arguments

    add_bench_arguments(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and (args.prompt is None) == (args.prompts_file is None):
        parser.error("generate takes a prompt or --prompts-file (one of the two)")
    from kvflow.entrypoints import cli_commands

    from kvflow import platform

    try:
        platform.current()  # a forced instruction set this CPU lacks is refused before anything loads
        if args.command == "env":
            from kvflow.entrypoints.env_report import main as env_main

            return env_main()
        if args.command == "generate":
            return cli_commands.generate(args)
        if args.command == "bench":
            from kvflow.bench.cli import run_bench

            return run_bench(args)
        if args.command == "serve":
            from kvflow.entrypoints.openai.api_server import serve

            return serve(args)
        return cli_commands.chat(args)
    except (ValueError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
