"""What structured output costs a decode step: 16 concurrent requests held to a JSON schema
against the same 16 prompts unconstrained, same max_tokens, one engine, in turns A B A B. TPOT is
each request's mean time between its output tokens (its first token excluded), averaged over the
requests; the ratio is per pair.

    python benchmarks/bench_structured.py [--rounds 3] [--requests 16] [--max-tokens 128]

The constrained requests end when their JSON is complete (finish_reason stop), so they produce
fewer tokens; the unconstrained ones ignore the end token and run to max_tokens. Per-token times
are what is compared.
"""

import argparse
import statistics
import time

from timing import tpot_ms

from kvflow import LLM, SamplingParams, StructuredOutputsParams

# A schema whose instances run long: an array of records.
SCHEMA = {
    "type": "object",
    "properties": {
        "people": {
            "type": "array",
            "minItems": 2,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 24},
                               "age": {"type": "integer", "minimum": 0, "maximum": 120},
                               "city": {"type": "string", "maxLength": 24},
                               "member": {"type": "boolean"}},
                "required": ["name", "age", "city", "member"],
                "additionalProperties": False,
            },
        },
    },
    "required": ["people"],
    "additionalProperties": False,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=128)
    args = parser.parse_args()
    llm = LLM()
    prompts = [f"List some people (set {i}) as JSON, with their name, age, city and membership." for i in
               range(args.requests)]
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                 structured_outputs=StructuredOutputsParams(json=SCHEMA))
    llm.generate(prompts[:2], constrained, use_tqdm=False)  # warm-up: the tokenizer's grammar view, the schema
    llm.generate(prompts[:2], plain, use_tqdm=False)
    rows = []
    for round_index in range(1, args.rounds + 1):
        start = time.perf_counter()
        a = llm.generate(prompts, plain, use_tqdm=False)
        a_wall = time.perf_counter() - start
        start = time.perf_counter()
        b = llm.generate(prompts, constrained, use_tqdm=False)
        b_wall = time.perf_counter() - start
        tokens = sum(len(o.outputs[0].token_ids) for o in b)
        complete = sum(o.outputs[0].finish_reason == "stop" for o in b)
        rows.append((round_index, tpot_ms(a), tpot_ms(b), a_wall, b_wall, tokens, complete))
        print(rows[-1], flush=True)
    print(f"\n{args.requests} requests, max_tokens {args.max_tokens}, greedy; one engine, in turns\n")
    print("| round | unconstrained TPOT (ms) | json_schema TPOT (ms) | ratio | json_schema tokens | complete JSON |")
    print("|---:|---:|---:|---:|---:|---:|")
    for r, ta, tb, _, _, tokens, complete in rows:
        print(f"| {r} | {ta:.2f} | {tb:.2f} | {tb / ta:.3f} | {tokens} | {complete}/{args.requests} |")
    print(f"\nmedian ratio {statistics.median(tb / ta for _, ta, tb, *_ in rows):.3f}")


if __name__ == "__main__":
    main()
