"""What batch-invariant mode costs: the same engine with the mode off and on, each in a fresh
process (the mode is process-wide), in turns A B A B, ratios per pair; for the quantized embedded
model (bfloat16 activations), its weights dequantized to bfloat16, and to float32.

    python benchmarks/bench_batch_invariant.py [--rounds 2] [--weights quantized bf16 float32]

Per engine, each the best of a few tries: TTFT of one 400-token prompt (prefill, one chunk), TPOT
of one request (64-token prompt) and of 16 at once (64 greedy tokens each, the first excluded). Ratios are on / off: above 1, the mode is slower.
Prefix caching is off, so every figure computes its prompt again.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

WEIGHTS = {"quantized": {"dtype": "bfloat16"},
           "bf16": {"dtype": "bfloat16", "dequantize_weights": True},
           "float32": {"dtype": "float32", "dequantize_weights": True}}
FIGURES = ["ttft_ms", "tpot1_ms", "tpot16_ms"]

_CHILD = """
import json, random, sys
sys.path.insert(0, {benchmarks!r})
from timing import tpot_ms
from kvflow import LLM, SamplingParams
options = json.loads(sys.argv[1])
llm = LLM(enable_prefix_caching=False, **options)
rng = random.Random(0)
vocab = llm.tokenizer.vocab_size
def prompt(n):
    return [rng.randrange(100, vocab) for _ in range(n)]
greedy = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate([prompt(32)], greedy, use_tqdm=False)  # warm up
ttft = min(llm.generate([prompt(400)], SamplingParams(max_tokens=1), use_tqdm=False)[0].metrics.ttft
           for _ in range(3))
tpot1 = min(tpot_ms(llm.generate([prompt(64)], greedy, use_tqdm=False)) for _ in range(3))
tpot16 = min(tpot_ms(llm.generate([prompt(64) for _ in range(16)], greedy, use_tqdm=False)) for _ in range(2))
print(json.dumps({{"ttft_ms": ttft * 1e3, "tpot1_ms": tpot1, "tpot16_ms": tpot16}}))
"""


def measure(options: dict) -> dict:
    code = _CHILD.format(benchmarks=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code, json.dumps(options)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    args = parser.parse_args()
    print("| weights | figure | mode off | mode on | on / off, per round |")
    print("|---|---|---:|---:|---|")
    for weights in args.weights:
        off, on = [], []
        for _ in range(args.rounds):
            off.append(measure(WEIGHTS[weights]))
            on.append(measure(dict(WEIGHTS[weights], batch_invariant=True)))
        for figure in FIGURES:
            a = statistics.median(r[figure] for r in off)
            b = statistics.median(r[figure] for r in on)
            ratios = ", ".join(f"{y[figure] / x[figure]:.2f}" for x, y in zip(off, on))
            print(f"| {weights} | {figure} | {a:.1f} | {b:.1f} | {ratios} |", flush=True)


if __name__ == "__main__":
    main()
