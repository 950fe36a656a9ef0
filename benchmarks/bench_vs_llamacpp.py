"""kvflow against llama.cpp on the same weights and CPU, interleaved in one run, with the ratios printed.

llama.cpp is built outside this repo (the vendored copy in the sdist of llama-cpp-python, CMake,
GGML_NATIVE=ON; targets llama-bench, llama-batched-bench, llama-quantize) and given the embedded
model as BF16 GGUF (`llama-quantize --allow-requantize IN.gguf OUT.gguf BF16`): its values are
those kvflow loads (the embedded Q4_1 file, dequantized to bf16). Each round measures, in turn:

- the read-bandwidth floor of batch-1 decode: the bytes of the weights kvflow streams per token
  (the LM head once) over the read bandwidth measured right before and right after kvflow's
  requests; and the floor of every byte a step reads, those weights and the KV cache it attends
  over (128 + 64 positions on average);
- one request: TTFT of a 128-token prompt and TPOT over 128 new tokens (kvflow) against
  `llama-bench -p 128 -n 128 -t THREADS` (TTFT = 128 / pp128 rate, TPOT = 1 / tg128 rate);
- offline: 64 random 128-token prompts submitted at once, 128 tokens out each, end tokens ignored,
  output tokens / wall time including prefill, against `llama-batched-bench -npp 128 -ntg 128
  -npl 64` (64 x 128 / its total time);
- with --contention, the same one-request TPOT of both while a busy loop is pinned to the last
  core (`taskset -c N`), both engines at their default threads: contended / clean, per engine.

    python benchmarks/bench_vs_llamacpp.py --llama-cpp-bin ../llama.cpp/build/bin --gguf smollm2-bf16.gguf
    python benchmarks/bench_vs_llamacpp.py --llama-cpp-bin ../llama.cpp/build/bin --gguf model.Q4_K_M.gguf --model model.Q4_K_M.gguf
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager

import torch

from kvflow import LLM, SamplingParams, platform
from timing import kv_read_per_token, read_bandwidth, weights_read_per_token, write_markdown


def run_json(command: list[str]) -> list[dict]:
    result = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-2000:]}")
    text = result.stdout.strip()
    if text.startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def llama_one_request(bin_dir: str, gguf: str, threads: int, repetitions: int) -> dict:
    rows = run_json([os.path.join(bin_dir, "llama-bench"), "-m", gguf, "-p", "128", "-n", "128", "-t", str(threads),
                     "-r", str(repetitions), "-o", "json"])
    pp = next(r for r in rows if r["n_prompt"] == 128 and r["n_gen"] == 0)
    tg = next(r for r in rows if r["n_gen"] == 128 and r["n_prompt"] == 0)
    return {"ttft": 128 / pp["avg_ts"], "tpot": 1 / tg["avg_ts"]}


def llama_offline(bin_dir: str, gguf: str, threads: int, requests: int) -> float:
    rows = run_json([os.path.join(bin_dir, "llama-batched-bench"), "-m", gguf, "-c", str(requests * 256 + 256),
                     "-b", "2048", "-ub", "512", "-npp", "128", "-ntg", "128", "-npl", str(requests), "-t",
                     str(threads), "--output-format", "jsonl"])
    row = rows[-1]
    return requests * 128 / row["t"]


def kvflow_one_request(llm: LLM, repetitions: int, seed: int) -> dict:
    rng = random.Random(seed)  # new prompts for every call: a repeated one would hit the prefix cache
    vocab = llm.tokenizer.vocab_size
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    ttfts, tpots = [], []
    for i in range(repetitions + 1):
        ids = [rng.randrange(100, vocab - 100) for _ in range(128)]
        metrics = llm.generate([ids], params, use_tqdm=False)[0].metrics
        if i:  # the first warms up
            ttfts.append(metrics.ttft)
            tpots.append(metrics.tpot)
    return {"ttft": statistics.median(ttfts), "tpot": statistics.median(tpots)}


def kvflow_offline(llm: LLM, requests: int, seed: int) -> float:
    rng = random.Random(seed)
    vocab = llm.tokenizer.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(128)] for _ in range(requests)]
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


@contextmanager
def busy_loop_on_last_core():
    core = max(os.sched_getaffinity(0))
    loop = subprocess.Popen(["taskset", "-c", str(core), sys.executable, "-c", "while True: pass"])
    time.sleep(0.5)
    try:
        yield core
    finally:
        loop.kill()
        loop.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--llama-cpp-bin", required=True, help="llama.cpp's build/bin (llama-bench, llama-batched-bench)")
    parser.add_argument("--gguf", required=True, help="the embedded model as a BF16 GGUF, for llama.cpp")
    parser.add_argument("--model", default=None,
                        help="the model kvflow runs (default: the embedded one); the --gguf file for the same file in both")
    parser.add_argument("--rounds", type=int, default=2, help="rounds, each measuring both engines in turn")
    parser.add_argument("--repetitions", type=int, default=3, help="one-request runs per engine and round")
    parser.add_argument("--requests", type=int, default=64, help="offline requests")
    parser.add_argument("--threads", type=int, default=None, help="llama.cpp's threads (default: torch's)")
    parser.add_argument("--no-offline", action="store_true")
    parser.add_argument("--contention", action="store_true", help="also TPOT beside a pinned busy loop")
    parser.add_argument("--num-scheduler-steps", type=int, default=8,
                        help="kvflow's decode steps per schedule (kvflow's default is 1: a step at a time)")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    threads = args.threads or torch.get_num_threads()
    cpu = platform.current()
    llm = LLM(args.model, kv_cache_memory=1 << 30, num_scheduler_steps=args.num_scheduler_steps)
    weight_bytes = weights_read_per_token(llm.engine.runner.model)
    kv_bytes = kv_read_per_token(llm, 128, 128)
    header = [f"kvflow vs llama.cpp, {cpu.model} ({cpu.isa} kernels; features: "
              f"{', '.join(f for f, on in cpu.features.items() if on)}), {torch.get_num_threads()} threads, "
              f"kvflow {llm.engine.config.dtype} ({args.num_scheduler_steps} decode steps per schedule) against "
              f"llama.cpp on {os.path.basename(args.gguf)}; "
              f"{weight_bytes / 1e6:.0f} MB of weights and {kv_bytes / 1e6:.1f} MB of KV cache read per token", ""]
    columns = ["round", "GB/s", "floor ms", "kvflow TPOT", "llama.cpp TPOT", "kvflow / floor", "with KV", "kvflow / llama.cpp TPOT",
               "kvflow TTFT", "llama.cpp TTFT", "kvflow / llama.cpp TTFT"]
    if not args.no_offline:
        columns += ["kvflow offline tok/s", "llama.cpp tok/s", "kvflow / llama.cpp"]
    if args.contention:
        columns += ["kvflow contended / clean", "llama.cpp contended / clean"]
    lines = header + ["| " + " | ".join(columns) + " |", "|" + "---:|" * len(columns)]
    print("\n".join(lines), flush=True)
    for round_index in range(args.rounds):
        before = read_bandwidth("cpu")
        ours = kvflow_one_request(llm, args.repetitions, seed=3 * round_index)
        after = read_bandwidth("cpu")  # before llama.cpp's run: the bandwidth drifts within seconds
        theirs = llama_one_request(args.llama_cpp_bin, args.gguf, threads, args.repetitions)
        bandwidth = (before + after) / 2
        floor = weight_bytes / (bandwidth * 1e9)
        floor_kv = (weight_bytes + kv_bytes) / (bandwidth * 1e9)
        cells = [str(round_index + 1), f"{bandwidth:.1f}", f"{floor * 1e3:.2f}", f"{ours['tpot'] * 1e3:.2f} ms",
                 f"{theirs['tpot'] * 1e3:.2f} ms", f"{ours['tpot'] / floor:.2f}x", f"{ours['tpot'] / floor_kv:.2f}x",
                 f"{ours['tpot'] / theirs['tpot']:.2f}x",
                 f"{ours['ttft'] * 1e3:.0f} ms", f"{theirs['ttft'] * 1e3:.0f} ms", f"{ours['ttft'] / theirs['ttft']:.2f}x"]
        if not args.no_offline:
            ours_offline = kvflow_offline(llm, args.requests, seed=3 * round_index + 1)
            theirs_offline = llama_offline(args.llama_cpp_bin, args.gguf, threads, args.requests)
            cells += [f"{ours_offline:.1f}", f"{theirs_offline:.1f}", f"{ours_offline / theirs_offline:.2f}x"]
        if args.contention:
            with busy_loop_on_last_core():
                ours_busy = kvflow_one_request(llm, args.repetitions, seed=3 * round_index + 2)
                theirs_busy = llama_one_request(args.llama_cpp_bin, args.gguf, threads, args.repetitions)
            cells += [f"{ours_busy['tpot'] / ours['tpot']:.2f}x ({ours_busy['tpot'] * 1e3:.1f} ms)",
                      f"{theirs_busy['tpot'] / theirs['tpot']:.2f}x ({theirs_busy['tpot'] * 1e3:.1f} ms)"]
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    write_markdown(args.markdown, lines)


if __name__ == "__main__":
    main()
