"""Two builds of kvflow against each other on this machine: A B A B ..., each run a fresh process
on the embedded model with the engine's defaults, the ratios taken pair by pair.

A build is a checkout's python/ directory with its kvflow._C built in place (`python setup.py
build_ext --inplace` in that checkout). Both builds register the same torch ops, so they cannot
share a process; alternating processes keeps the ratio meaningful when the machine's speed drifts.

Each run measures:
- one request: 128 random prompt ids, 128 greedy tokens out, six requests after a warm-up; each
  one's TPOT over the decode floor (the bytes of the weights, the LM head once, over the read
  bandwidth measured right before and right after it), median over the six. This VM's bandwidth
  moves by up to 1.5x from minute to minute, so raw TPOTs of two runs compare the machine's
  moments as much as the builds; the floor ratio does not;
- with --offline, 64 random 128-token prompts at once, 128 tokens out each, end tokens ignored:
  output tokens / wall time, the better of two;
- the process's resident memory after the runs (VmRSS).

With --dequantize-weights both builds run the bf16 path (the embedded model's weights
dequantized at load, as a bf16 checkpoint would load); a build from before quantized weights
always does.

    python benchmarks/bench_builds.py --a ../before/python --b python --pairs 6 --offline
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def resident_mib() -> float:
    with open("/proc/self/status") as status:
        kib = next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))
    return kib / 1024


def load_options(dequantize_weights: bool) -> dict:
    """LLM options for this build: a build from before quantized weights has no
    dequantize_weights option, and loads every GGUF file dequantized."""
    import dataclasses

    from kvflow.engine.config import EngineConfig

    if "dequantize_weights" not in {f.name for f in dataclasses.fields(EngineConfig)}:
        return {}
    return {"dequantize_weights": dequantize_weights}


def one_run(offline: bool, dequantize_weights: bool) -> dict:
    from kvflow import LLM, SamplingParams
    from timing import read_bandwidth, weights_read_per_token

    llm = LLM(**load_options(dequantize_weights))
    weight_bytes = weights_read_per_token(llm.engine.runner.model)
    vocab = llm.tokenizer.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    floor_ratios, tpots = [], []
    bandwidth_before = read_bandwidth("cpu")
    for i in range(7):
        ids = [rng.randrange(100, vocab - 100) for _ in range(128)]
        metrics = llm.generate([ids], params, use_tqdm=False)[0].metrics
        bandwidth_after = read_bandwidth("cpu")
        if i:  # the first warms up
            bandwidth = (bandwidth_before + bandwidth_after) / 2
            floor_ratios.append(metrics.tpot / (weight_bytes / (bandwidth * 1e9)))
            tpots.append(metrics.tpot)
        bandwidth_before = bandwidth_after
    result = {"floor_ratio": statistics.median(floor_ratios), "tpot_ms": 1e3 * statistics.median(tpots)}
    if offline:
        rates = []
        for repetition in range(2):
            rng = random.Random(1 + repetition)
            prompts = [[rng.randrange(100, vocab - 100) for _ in range(128)] for _ in range(64)]
            start = time.perf_counter()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            rates.append(sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start))
        result["offline_tokens_per_s"] = max(rates)
    result["rss_mib"] = resident_mib()
    return result


def run_build(path: str, offline: bool, dequantize_weights: bool) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.abspath(path), HERE]))
    command = ([sys.executable, os.path.abspath(__file__), "--child"] + (["--offline"] if offline else [])
               + (["--dequantize-weights"] if dequantize_weights else []))
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    if result.returncode != 0:
        raise RuntimeError(f"the run of {path} failed:\n{result.stderr[-2000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", help="build A: a checkout's python/ directory")
    parser.add_argument("--b", help="build B")
    parser.add_argument("--pairs", type=int, default=6)
    parser.add_argument("--offline", action="store_true", help="also offline throughput, 64 requests")
    parser.add_argument("--dequantize-weights", action="store_true", help="the bf16 path: weights dequantized at load")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(one_run(args.offline, args.dequantize_weights)))
        return
    if not (args.a and args.b):
        parser.error("--a and --b are required")
    keys = ["floor_ratio", "tpot_ms"] + (["offline_tokens_per_s"] if args.offline else []) + ["rss_mib"]
    rows = []
    print("| pair | " + " | ".join(f"A {k} | B {k} | A/B" for k in keys) + " |")
    print("|---:|" + "---:|---:|---:|" * len(keys))
    for pair in range(1, args.pairs + 1):
        a = run_build(args.a, args.offline, args.dequantize_weights)
        b = run_build(args.b, args.offline, args.dequantize_weights)
        rows.append((a, b))
        cells = [f"{a[k]:.3f} | {b[k]:.3f} | {a[k] / b[k]:.3f}" for k in keys]
        print(f"| {pair} | " + " | ".join(cells) + " |", flush=True)
    for k in keys:
        ratios = [a[k] / b[k] for a, b in rows]
        print(f"{k}: A/B median {statistics.median(ratios):.3f} over {len(rows)} pairs "
              f"({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
