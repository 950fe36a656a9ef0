"""What the interleaved layout of the embedded model's tied Q8_0 embedding / LM head gives: the
default engine against one whose table is put back in GGUF's layout, both in one process, in
turns A B A B, ratios per pair.

    python benchmarks/bench_interleaved_lm_head.py [--rounds 3] [--speculative]

Figures: TPOT of one request (a 128-token prompt, 128 greedy tokens, the best of two tries) and
offline throughput (64 prompts of 128 random tokens, 128 tokens out each, output tokens per second
of wall time); with --speculative, n-gram speculation's TPOT over the first four input-grounded
prompts of benchmarks/data/speculative_prompts.json at one request (its verification steps put up
to 5 rows through the LM head). Ratios are GGUF / interleaved for TPOT, interleaved / GGUF for
throughput: above 1, the interleaved layout is faster.
"""

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch
from timing import tpot_ms

from kvflow import LLM, SamplingParams
from kvflow.ops.quantized import GGML_Q8_0, GGML_Q8_0_INTERLEAVED, deinterleave_rows

PROMPTS = Path(__file__).parent / "data" / "speculative_prompts.json"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def put_back_in_gguf_layout(llm: LLM) -> None:
    """The tied table (and so the LM head) back in GGUF's rows; the CPU programs captured at start-up
    held the interleaved one, so they are captured again on the next steps."""
    embedding = llm.engine.runner.model.embed_tokens
    if embedding.ggml_type != GGML_Q8_0_INTERLEAVED:
        raise SystemExit(f"the embedding is of type {embedding.ggml_type}, not the interleaved Q8_0 this compares")
    embedding.weight = torch.nn.Parameter(deinterleave_rows(embedding.weight.data, GGML_Q8_0), requires_grad=False)
    embedding.ggml_type = GGML_Q8_0
    programs = llm.engine.runner.cpu_programs
    if programs is not None:
        programs.programs.clear()
        programs.refusals.clear()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--speculative", action="store_true")
    args = parser.parse_args()
    speculative = NGRAM if args.speculative else None
    engines = {"interleaved": LLM(enable_prefix_caching=False, speculative_config=speculative),
               "gguf": LLM(enable_prefix_caching=False, speculative_config=speculative)}
    put_back_in_gguf_layout(engines["gguf"])
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 49000) for _ in range(n)]

    greedy = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    grounded = json.loads(PROMPTS.read_text())["grounded"][:4]
    figures = {name: {} for name in engines}
    for llm in engines.values():
        llm.generate([prompt(32)], greedy, use_tqdm=False)  # warm up
    for _ in range(args.rounds):
        for name, llm in engines.items():
            if args.speculative:
                tokenizer = llm.tokenizer
                tpots = [tpot_ms(llm.generate([tokenizer.encode(tokenizer.apply_chat_template(
                    [{"role": "user", "content": text}]))], SamplingParams(temperature=0, max_tokens=96),
                    use_tqdm=False)) for text in grounded]
                figures[name].setdefault("speculative TPOT, grounded, 1 request (ms)", []).append(statistics.mean(tpots))
                continue
            tpot = min(tpot_ms(llm.generate([prompt(128)], greedy, use_tqdm=False)) for _ in range(2))
            figures[name].setdefault("TPOT, 1 request (ms)", []).append(tpot)
            start = time.perf_counter()
            outputs = llm.generate([prompt(128) for _ in range(64)], greedy, use_tqdm=False)
            tokens = sum(len(out.outputs[0].token_ids) for out in outputs)
            figures[name].setdefault("offline, 64 requests (tok/s)", []).append(tokens / (time.perf_counter() - start))
    print("| figure | GGUF layout | interleaved | ratio, per round |")
    print("|---|---:|---:|---|")
    for figure, interleaved in figures["interleaved"].items():
        gguf = figures["gguf"][figure]
        pairs = zip(interleaved, gguf)
        ratios = [(b / a if "TPOT" in figure else a / b) for a, b in pairs]
        print(f"| {figure} | {statistics.median(gguf):.2f} | {statistics.median(interleaved):.2f} | "
              f"{', '.join(f'{r:.2f}' for r in ratios)} |")


if __name__ == "__main__":
    main()
