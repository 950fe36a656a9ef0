"""What n-gram speculative decoding gives: the same prompts through an engine without drafts and
one with them, in turns A B A B, greedy, ratios per pair.

    python benchmarks/bench_speculative.py [--rounds 3] [--k 4] [--max-tokens 96] [--draft-model]

--draft-model: the embedded model's quantized weights draft for its dequantized ones (both
engines then run the dequantized target; the quantized default's TPOT is printed beside them).

Workloads (benchmarks/data/speculative_prompts.json, in the model's chat template):
  grounded  answers that repeat spans of the prompt: copy or summarise a text, edit code and
            print all of it, extract lines
  free      open-ended answers
each at concurrency 1 (one request at a time) and 16 (sixteen at once), compared by TPOT (each
request's mean time between output tokens, its first excluded; mean over requests); and offline
throughput, 64 requests of both kinds at once, by output tokens per second. Ratios are plain /
speculative for TPOT and speculative / plain for throughput: above 1, speculation is faster.
Last, each grounded prompt's own ratio at concurrency 1, and the share of its output tokens
that were accepted drafts.
Prefix caching is off in both engines so that every round computes its prompts again.
"""

import argparse
import json
import statistics
import time
from pathlib import Path

from timing import tpot_ms

from kvflow import LLM, SamplingParams

PROMPTS = Path(__file__).parent / "data" / "speculative_prompts.json"


def at_concurrency(llm: LLM, prompts: list[str], params: SamplingParams, concurrency: int) -> list:
    outputs = []
    for start in range(0, len(prompts), concurrency):
        outputs += llm.generate(prompts[start:start + concurrency], params, use_tqdm=False)
    return outputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--draft-model", action="store_true")
    args = parser.parse_args()
    if args.draft_model:
        spec = {"method": "draft_model", "model": "SmolLM2-135M-Instruct", "num_speculative_tokens": args.k}
    else:
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    options = dict(dtype=args.dtype, enable_prefix_caching=False, dequantize_weights=args.draft_model)
    engines = {"plain": LLM(**options), "ngram": LLM(**options, speculative_config=spec)}
    if args.draft_model:
        engines["quantized"] = LLM(dtype=args.dtype, enable_prefix_caching=False)
    tokenizer = engines["plain"].tokenizer
    texts = json.loads(PROMPTS.read_text())
    prompts = {kind: [tokenizer.apply_chat_template([{"role": "user", "content": text}]) for text in texts[kind]]
               for kind in ("grounded", "free")}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    workloads = [(f"{kind}, concurrency {c}", prompts[kind] * (2 if c == 16 else 1), c)
                 for kind in ("grounded", "free") for c in (1, 16)]
    mixed = (prompts["grounded"] + prompts["free"]) * 4
    for llm in engines.values():  # warm up: every program class either engine will meet
        at_concurrency(llm, prompts["grounded"][:2] + prompts["free"][:2], params, 16)
    results = {name: [] for name, _, _ in workloads} | {"offline, 64 requests": []}
    agree = {"same": 0, "total": 0}
    per_prompt = {}  # grounded prompt index -> [(its TPOT ratio, share of its tokens from accepted drafts)] by round
    for round_index in range(args.rounds):
        for name, batch, concurrency in workloads:
            got = {}
            for label, llm in engines.items():
                outputs = at_concurrency(llm, batch, params, concurrency)
                got[label] = (tpot_ms(outputs), outputs)
            ratio = got["plain"][0] / got["ngram"][0]
            if "quantized" in got:
                print(f"round {round_index}: {name}: TPOT of the quantized default {got['quantized'][0]:.2f} ms "
                      f"({got['quantized'][0] / got['ngram'][0]:.2f}x the speculative dequantized target's)")
            accepted = [o.metrics.acceptance_rate for o in got["ngram"][1] if o.metrics.acceptance_rate is not None]
            length = [o.metrics.mean_accepted_length for o in got["ngram"][1]
                      if o.metrics.mean_accepted_length is not None]
            for a, b in zip(got["plain"][1], got["ngram"][1]):
                agree["same"] += a.outputs[0].token_ids == b.outputs[0].token_ids
                agree["total"] += 1
            results[name].append(ratio)
            if name == "grounded, concurrency 1":
                for i, (a, b) in enumerate(zip(got["plain"][1], got["ngram"][1])):
                    if len(a.outputs[0].token_ids) > 1 and len(b.outputs[0].token_ids) > 1:
                        copied = b.metrics.num_accepted_tokens / len(b.outputs[0].token_ids)
                        per_prompt.setdefault(i, []).append((tpot_ms([a]) / tpot_ms([b]), copied))
            print(f"round {round_index}: {name}: TPOT plain {got['plain'][0]:.2f} ms, {spec['method']} "
                  f"{got['ngram'][0]:.2f} ms "
                  f"-> {ratio:.2f}x; acceptance {statistics.mean(accepted) if accepted else 0:.2f}, "
                  f"tokens per verification {statistics.mean(length) if length else 0:.2f}", flush=True)
        rates = {}
        for label, llm in list(engines.items())[:2]:
            start = time.perf_counter()
            outputs = llm.generate(mixed, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            rates[label] = sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed
        ratio = rates["ngram"] / rates["plain"]
        results["offline, 64 requests"].append(ratio)
        print(f"round {round_index}: offline, 64 requests: plain {rates['plain']:.1f} tok/s, {spec['method']} "
              f"{rates['ngram']:.1f} tok/s -> {ratio:.2f}x", flush=True)
    print("\nmedian ratio over rounds (above 1: speculation faster)")
    for name, ratios in results.items():
        print(f"  {name:<28} {statistics.median(ratios):.2f}x   (rounds: {', '.join(f'{r:.2f}' for r in ratios)})")
    print(f"greedy outputs identical with and without drafts (default mode): {agree['same']} of {agree['total']}")
    print("\ngrounded prompts one at a time: TPOT ratio and the share of output tokens that were accepted drafts "
          "(medians over rounds)")
    for i, pairs in sorted(per_prompt.items()):
        print(f"  {statistics.median(r for r, _ in pairs):5.2f}x  {statistics.median(c for _, c in pairs):4.0%}  "
              f"{texts['grounded'][i].splitlines()[0][:70]}")


if __name__ == "__main__":
    main()
