"""A GGUF model with its quantized weights kept in their blocks (the default) against the same file
dequantized to bf16 (--dequantize-weights), both engines in one process, measured in turns A B A B
so that the machine's drift falls on both alike; the ratios are per pair.

- TTFT: a 128-token prompt to its first greedy token;
- TPOT: the mean time per token over the following 127 greedy tokens (128 in all);
- the decode floor: the bytes of the weights each engine holds (the LM head once) over the read
  bandwidth measured right before and right after that engine's request (a sum over a 512 MB
  tensor); and the floor of every byte a step reads: those weights and the KV cache it attends
  over (128 + 64 positions on average);
- the quantized weights' floor at the rate a sum over a tensor of their own size reads, measured
  after each round's requests: where the weights fit in the last-level cache, they stream from it
  faster than from memory, and this floor is the one their products are up against;
- offline: 64 prompts of 128 random tokens at once, 128 tokens out each, output tokens per second
  of wall time (prefill included);
- the resident memory a fresh process gains by loading each;
- perplexity over a fixed English text (the input-grounded prompts of
  benchmarks/data/speculative_prompts.json, one prefill) through the quantized weights with
  bf16 activations, against the same file dequantized to float32 (the issue's bound: within 1%).

    python benchmarks/bench_quantized.py                      # the embedded Q4_1 model
    python benchmarks/bench_quantized.py --model model.Q8_0.gguf --rounds 5
    python benchmarks/bench_quantized.py --requantize Q8_0 --llama-quantize LLAMA_BUILD/bin/llama-quantize

--requantize TYPE first writes the model in TYPE with llama.cpp's llama-quantize (built outside
the repo; `--allow-requantize`, so a Q4_1 file's values requantized) into a temporary directory,
and measures that file.
"""

import argparse
import random
import statistics
import os
import subprocess
import sys
import tempfile
import time

import json
import math
from pathlib import Path

import torch

from kvflow import LLM, SamplingParams, platform
from kvflow.attention_metadata import AttentionMetadata
from kvflow.engine.kv_cache import allocate_kv_caches
from kvflow.loader import load_model, resolve_model_path
from timing import kv_read_per_token, read_bandwidth, weights_read_per_token, write_markdown

_RSS_PROBE = """
import sys, torch
from kvflow.loader import load_model
def rss():
    return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS")) * 1024
before = rss()
lm = load_model(sys.argv[1] or None, torch.bfloat16, dequantize_weights=sys.argv[2] == "1")
print(rss() - before)
"""


def loaded_rss(model: str | None, dequantize: bool) -> int:
    """Resident bytes a fresh process gains by loading the model (weights, tokenizer, mapped file)."""
    out = subprocess.run([sys.executable, "-c", _RSS_PROBE, model or "", "1" if dequantize else "0"],
                         capture_output=True, text=True, check=True).stdout.split()
    return int(out[-1])


PERPLEXITY_TEXT = Path(__file__).parent / "data" / "speculative_prompts.json"
PERPLEXITY_BLOCK_SIZE = 16


def perplexity(model: str | None, dtype: torch.dtype, dequantize: bool) -> tuple[float, int]:
    """exp(mean negative log-likelihood) of the fixed text's tokens given their prefixes, from one
    prefill of the model loaded with these weights and activations; and the token count."""
    lm = load_model(model, dtype, dequantize_weights=dequantize)
    text = "\n\n".join(json.loads(PERPLEXITY_TEXT.read_text())["grounded"])
    ids = lm.tokenizer.encode(text)[:1024]
    blocks = -(-len(ids) // PERPLEXITY_BLOCK_SIZE)
    kv_caches = allocate_kv_caches(lm.config, blocks, PERPLEXITY_BLOCK_SIZE, lm.dtype, "cpu")
    metadata = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(blocks))], PERPLEXITY_BLOCK_SIZE)
    with torch.inference_mode():
        logits = lm.model.compute_logits(lm.model(torch.tensor(ids), metadata, kv_caches))[:-1].float()
    return math.exp(torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).item()), len(ids)


def one_request(llm: LLM, ids: list[int], new_tokens: int) -> tuple[float, float]:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    metrics = llm.generate([ids], params, use_tqdm=False)[0].metrics
    return metrics.ttft, metrics.tpot


def offline(llm: LLM, prompts: list[list[int]], new_tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file (default: the embedded Q4_1 model)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--offline-requests", type=int, default=64, help="0 to skip the offline figure")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    parser.add_argument("--requantize", default=None, metavar="TYPE",
                        help="measure the model requantized to this GGML type (Q8_0, Q4_0, ...) by llama-quantize")
    parser.add_argument("--llama-quantize", default="llama-quantize", help="llama.cpp's llama-quantize, for --requantize")
    parser.add_argument("--num-scheduler-steps", type=int, default=8,
                        help="decode steps per schedule, both engines (kvflow's default is 1: a step at a time)")
    args = parser.parse_args()
    if args.requantize:
        with tempfile.TemporaryDirectory() as directory:
            args.model = requantized(args.llama_quantize, resolve_model_path(args.model), args.requantize, directory)
            return measure(args)
    return measure(args)


def requantized(llama_quantize: str, model: str, ggml_type: str, directory: str) -> str:
    """model written in ggml_type by llama-quantize, into directory; its path."""
    name = os.path.basename(model).rsplit(".", 2)[0] + f".{ggml_type}.gguf"
    path = os.path.join(directory, name)
    result = subprocess.run([llama_quantize, "--allow-requantize", model, path, ggml_type], capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise SystemExit(f"{llama_quantize} failed:\n{result.stderr[-2000:]}")
    print(f"requantized {model} to {ggml_type}: {path} ({os.path.getsize(path) / 1e6:.0f} MB)", flush=True)
    return path


def measure(args) -> None:
    engines = {}
    for name, dequantize in (("quantized", False), ("bf16", True)):
        engines[name] = LLM(args.model, dtype="bfloat16", enable_prefix_caching=False, kv_cache_memory=1 << 30,
                            dequantize_weights=dequantize, num_scheduler_steps=args.num_scheduler_steps)
    weight_bytes = {name: weights_read_per_token(llm.engine.runner.model)
                    for name, llm in engines.items()}
    kv_bytes = {name: kv_read_per_token(llm, 128, 128) for name, llm in engines.items()}
    rng = random.Random(0)
    vocab = engines["quantized"].engine.model_config.vocab_size
    ids = [rng.randrange(100, vocab) for _ in range(128)]
    prompts = [[rng.randrange(100, vocab) for _ in range(128)] for _ in range(args.offline_requests)]
    for llm in engines.values():  # warm-up: programs captured, pages touched
        one_request(llm, ids, 8)
        if prompts:
            offline(llm, prompts[:8], 8)

    rows = []
    for round_ in range(args.rounds):
        figures, bandwidth = {}, {}
        for name, llm in engines.items():  # the bandwidth around each request: it drifts in seconds
            before = read_bandwidth("cpu")
            figures[name] = one_request(llm, ids, 128)
            bandwidth[name] = (before + read_bandwidth("cpu")) / 2
        own_size_bandwidth = read_bandwidth("cpu", weight_bytes["quantized"])
        throughput = {name: offline(llm, prompts, 128) if prompts else float("nan") for name, llm in engines.items()}
        row = {"round": round_ + 1, "bandwidth": bandwidth["quantized"], "own_size_bandwidth": own_size_bandwidth}
        for name in engines:
            row[name] = {"ttft": figures[name][0], "tpot": figures[name][1],
                         "floor": weight_bytes[name] / (bandwidth[name] * 1e9),
                         "floor_kv": (weight_bytes[name] + kv_bytes[name]) / (bandwidth[name] * 1e9),
                         "offline": throughput[name]}
        row["quantized"]["own_size_floor"] = weight_bytes["quantized"] / (own_size_bandwidth * 1e9)
        rows.append(row)
        print(row, flush=True)

    cpu = platform.current()
    lines = [
        f"{resolve_model_path(args.model).rsplit('/', 1)[-1]}: quantized weights ({weight_bytes['quantized'] / 1e6:.0f} MB) "
        f"against the same dequantized to bf16 ({weight_bytes['bf16'] / 1e6:.0f} MB), one process, in turns; "
        f"{cpu.model} ({cpu.isa} kernels), {torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"{args.num_scheduler_steps} decode steps per schedule",
        "",
        "| round | GB/s | quantized TTFT (ms) | bf16 TTFT (ms) | TTFT ratio | quantized TPOT (ms) | bf16 TPOT (ms) "
        "| TPOT ratio | quantized / its floor | with KV | GB/s at the weights' size | quantized / that floor "
        "| bf16 / its floor | quantized offline tok/s | bf16 offline tok/s | offline ratio |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        q, b = row["quantized"], row["bf16"]
        lines.append(f"| {row['round']} | {row['bandwidth']:.1f} | {q['ttft'] * 1e3:.0f} | {b['ttft'] * 1e3:.0f} | "
                     f"{q['ttft'] / b['ttft']:.2f} | {q['tpot'] * 1e3:.2f} | {b['tpot'] * 1e3:.2f} | "
                     f"{q['tpot'] / b['tpot']:.2f} | {q['tpot'] / q['floor']:.2f} | {q['tpot'] / q['floor_kv']:.2f} | "
                     f"{row['own_size_bandwidth']:.1f} | {q['tpot'] / q['own_size_floor']:.2f} | "
                     f"{b['tpot'] / b['floor']:.2f} | "
                     f"{q['offline']:.0f} | {b['offline']:.0f} | {q['offline'] / b['offline']:.2f} |")

    summary = {key: statistics.median(row["quantized"][key] / row["bf16"][key] for row in rows)
               for key in ("ttft", "tpot", "offline")}
    floor_ratio = statistics.median(row["quantized"]["tpot"] / row["quantized"]["floor"] for row in rows)
    floor_kv_ratio = statistics.median(row["quantized"]["tpot"] / row["quantized"]["floor_kv"] for row in rows)
    own_size_ratio = statistics.median(row["quantized"]["tpot"] / row["quantized"]["own_size_floor"] for row in rows)
    lines += ["", f"medians: quantized / bf16 TTFT {summary['ttft']:.2f}x, TPOT {summary['tpot']:.2f}x, offline "
                  f"throughput {summary['offline']:.2f}x; quantized TPOT {floor_ratio:.2f}x its weights' floor, "
                  f"{floor_kv_ratio:.2f}x with the KV cache read ({kv_bytes['quantized'] / 1e6:.1f} MB a step); "
                  f"{own_size_ratio:.2f}x the weights' floor at the rate a tensor of their size reads (from the "
                  f"last-level cache if they fit in it)"]
    lines += ["", "| weights | weights read per token (MB) | RSS a fresh process gains by loading (MB) |", "|---|---:|---:|"]
    for name, dequantize in (("quantized", False), ("bf16", True)):
        lines.append(f"| {name} | {weight_bytes[name] / 1e6:.1f} | {loaded_rss(args.model, dequantize) / 1e6:.1f} |")
    quantized, tokens = perplexity(args.model, torch.bfloat16, dequantize=False)
    reference, _ = perplexity(args.model, torch.float32, dequantize=True)
    lines += ["", f"perplexity over {tokens} tokens: quantized (bf16 activations) {quantized:.4f}, dequantized "
                  f"float32 {reference:.4f}, ratio {quantized / reference:.4f}"]
    print("\n".join(lines))
    write_markdown(args.markdown, lines)


if __name__ == "__main__":
    main()
