"""Offline throughput: N requests with prompt lengths uniform in [32, 256] and 128 output tokens
each (end tokens ignored), through kvflow's continuous-batching engine, against Hugging Face
transformers in the same run, one request at a time and as one left-padded static batch.

Output tokens per second for each. HF one-at-a-time is a rate, so it is measured on the first
--hf-single-requests requests (all N would take many minutes) and reported per token. Also the
fraction of the machine's compute floor kvflow reaches: the bf16 matmul FLOP/s measured here
divided by the model's FLOPs per token (2 x parameters, the embedding gather excluded, attention
over the context included) gives the output tokens/s no engine can exceed; and, since every prompt
token goes through the layers too, the FLOP/s kvflow sustains over prompt and output tokens
together (the LM head counted only where a token is sampled) as a fraction of that peak.

    python benchmarks/bench_offline.py                   # 64 requests
    python benchmarks/bench_offline.py --requests 16 --hf-single-requests 2
"""

import argparse
import os
import random
import time

import torch

from kvflow import LLM, SamplingParams
from kvflow.loader import resolve_model_path
from timing import write_markdown


def make_prompts(tokenizer, count: int, seed: int) -> list[list[int]]:
    words = ("the of and to in is was for on that with as by at from his her an which or were are this be had "
             "not but they have one all their there been has when who will more no if out so said what up its "
             "about into than them can only other new some could time these two may then do first any my now "
             "such like our over man me even most made after also did many before must through back years where "
             "much your way well down should because each just those people how too little state good very make "
             "world still own see men work long get here between both life being under never day same another "
             "know while last might us great old year off come since against go came right used take three").split()
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        length = rng.randint(32, 256)
        ids = tokenizer.encode(" ".join(rng.choice(words) for _ in range(length * 2)))
        prompts.append(ids[:length])
    return prompts


def matmul_flops(dtype=torch.bfloat16, size: int = 2048) -> float:
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    a @ b
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


def layer_flops_per_token(config, mean_context: float) -> float:
    """The decoder layers' FLOPs for one token: the projections, and attention over the context."""
    h, q, kv, i = config.hidden_size, config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim, \
        config.intermediate_size
    return config.num_layers * (2 * (h * (q + 2 * kv) + q * h + 3 * h * i) + 4 * q * mean_context)


def lm_head_flops(config) -> float:
    return 2 * config.hidden_size * config.vocab_size


def model_flops_per_token(config, mean_context: float) -> float:
    return layer_flops_per_token(config, mean_context) + lm_head_flops(config)


def hf_model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(path)
    if os.path.isdir(path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype).eval()


def hf_one_at_a_time(model, prompts, new_tokens) -> float:
    generated, start = 0, time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                 do_sample=False, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
            generated += out.shape[1] - len(ids)
    return generated / (time.perf_counter() - start)


def hf_static_batch(model, prompts, new_tokens, pad_id: int) -> float:
    width = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=pad_id)
    return (out.shape[1] - width) * len(prompts) / (time.perf_counter() - start)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--hf-single-requests", type=int, default=4)
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()

    llm = LLM(args.model, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens)
    prompts = make_prompts(llm.tokenizer, args.requests, seed=0)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    ours = sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed
    ttfts = sorted(o.metrics.ttft for o in outputs)
    flops = matmul_flops()
    mean_context = sum(len(p) for p in prompts) / len(prompts) + args.new_tokens / 2
    ceiling = flops / model_flops_per_token(llm.engine.model_config, mean_context)
    # What the run computes: every prompt token and every output token but the last goes through
    # the layers; the LM head runs only where a token is sampled (one row per output token).
    config = llm.engine.model_config
    forward_tokens = sum(len(p) for p in prompts) + len(prompts) * (args.new_tokens - 1)
    used_flops = (forward_tokens * layer_flops_per_token(config, mean_context)
                  + len(prompts) * args.new_tokens * lm_head_flops(config))

    rows = [("kvflow engine", ours)]
    if not args.no_hf:
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else torch.float32
        model = hf_model(resolve_model_path(args.model), dtype)
        rows.append((f"HF one at a time ({args.hf_single_requests} requests)",
                     hf_one_at_a_time(model, prompts[: args.hf_single_requests], args.new_tokens)))
        rows.append((f"HF static batch of {args.requests}",
                     hf_static_batch(model, prompts, args.new_tokens, llm.tokenizer.eos_token_id or 0)))
    lines = [
        f"{args.requests} requests, prompts of 32-256 tokens, {args.new_tokens} output tokens each, {args.dtype}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads",
        "",
        "| engine | output tokens/s | kvflow's speedup |",
        "|---|---:|---:|",
    ]
    lines += [f"| {name} | {rate:.1f} | {ours / rate:.2f}x |" for name, rate in rows]
    lines += ["", f"kvflow: {elapsed:.1f} s for {args.requests} requests; TTFT p50 {ttfts[len(ttfts) // 2]:.2f} s, "
                  f"p99 {ttfts[min(len(ttfts) - 1, int(len(ttfts) * 0.99))]:.2f} s; preemptions "
                  f"{llm.engine.scheduler.num_preemptions}",
              f"compute floor: bf16 matmul {flops / 1e9:.0f} GFLOP/s / "
              f"{model_flops_per_token(llm.engine.model_config, mean_context) / 1e6:.0f} MFLOP per token = "
              f"{ceiling:.0f} tokens/s; kvflow reaches {ours / ceiling:.0%} of it",
              f"counting the prompt tokens too (every prompt token goes through the layers as well): "
              f"{used_flops / elapsed / 1e9:.0f} GFLOP/s, {used_flops / elapsed / flops:.0%} of the measured matmul peak"]
    print("\n".join(lines))
    write_markdown(args.markdown, lines)


if __name__ == "__main__":
    main()
