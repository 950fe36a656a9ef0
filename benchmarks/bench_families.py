"""Decode speed of each model family at a real shape, on random bf16 weights: batch-1 TPOT against
the read-bandwidth floor, and offline throughput, with the embedded SmolLM2-135M as the reference.

Each shape is a released model's config (Qwen3-0.6B, Gemma-3-270M, Llama-3.2-1B) with random
weights, written once as a safetensors directory under --cache with a word-level tokenizer over its
vocabulary (prompts are random token ids). Each model runs in a fresh process with the engine's
defaults. The floor is the bytes of the weights kvflow holds (the tied embedding once, as the LM
head) over the read bandwidth measured right before and right after each request.

    python benchmarks/bench_families.py [--models smollm2 qwen3-0.6b gemma3-270m llama3.2-1b]
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

# Released configs, reduced to the fields that shape the computation.
SHAPES = {
    "qwen3-0.6b": {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 151936, "hidden_size": 1024,
                   "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16,
                   "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960,
                   "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
                   "hidden_act": "silu", "attention_bias": False},
    "gemma3-270m": {"architectures": ["Gemma3ForCausalLM"], "vocab_size": 262144, "hidden_size": 640,
                    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4,
                    "num_key_value_heads": 1, "head_dim": 256, "max_position_embeddings": 32768,
                    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                    "sliding_window": 512, "query_pre_attn_scalar": 256, "tie_word_embeddings": True,
                    "hidden_activation": "gelu_pytorch_tanh",
                    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)]},
    "llama3.2-1b": {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 2048,
                    "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
                    "num_key_value_heads": 8, "head_dim": 64, "max_position_embeddings": 131072,
                    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": True, "hidden_act": "silu",
                    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
}


def write_random_checkpoint(name: str, directory: str) -> None:
    """config.json, random bf16 weights (projections N(0, 0.02), norm weights at their neutral
    value) and a word-level tokenizer with one token per id."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models

    from kvflow.models.config import ModelConfig
    from kvflow.models.registry import model_class

    config = SHAPES[name]
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    model_config = ModelConfig.from_hf(config)
    graph = model_class(model_config.architecture)(model_config.with_context(1024), torch.bfloat16)
    torch.manual_seed(0)
    tensors = {}
    with torch.no_grad():
        for parameter_name, parameter in graph.named_parameters():
            if "norm" in parameter_name:
                parameter.fill_(0.0 if "Gemma" in model_config.architecture else 1.0)
            else:
                parameter.normal_(0.0, 0.02)
            tensors[parameter_name] = parameter.detach().contiguous()
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    vocab = {f"t{i}": i for i in range(config["vocab_size"])}
    Tokenizer(models.WordLevel(vocab, unk_token="t0")).save(os.path.join(directory, "tokenizer.json"))


def one_model(model: str | None, requests: int) -> dict:
    from kvflow import LLM, SamplingParams
    from timing import read_bandwidth, weights_read_per_token

    start = time.perf_counter()
    llm = LLM(model=model, max_model_len=1024)
    load_seconds = time.perf_counter() - start
    graph = llm.engine.runner.model
    weight_bytes = weights_read_per_token(graph)
    vocab = llm.engine.model_config.vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
    ratios, tpots, ttfts = [], [], []
    before = read_bandwidth("cpu")
    for i in range(4):
        ids = [rng.randrange(1, vocab) for _ in range(128)]
        metrics = llm.generate([ids], params, use_tqdm=False)[0].metrics
        after = read_bandwidth("cpu")
        if i:  # the first warms up
            bandwidth = (before + after) / 2
            ratios.append(metrics.tpot / (weight_bytes / (bandwidth * 1e9)))
            tpots.append(metrics.tpot)
            ttfts.append(metrics.ttft)
        before = after
    prompts = [[rng.randrange(1, vocab) for _ in range(128)] for _ in range(requests)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    offline = sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)
    return {"parameters": sum(p.numel() for p in graph.parameters()), "weight_bytes": weight_bytes,
            "load_s": load_seconds, "tpot_ms": statistics.median(tpots) * 1e3,
            "ttft_ms": statistics.median(ttfts) * 1e3, "floor_ratio": statistics.median(ratios),
            "floor_ratio_range": (min(ratios), max(ratios)), "offline_tokens_per_s": offline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["smollm2", *SHAPES])
    parser.add_argument("--requests", type=int, default=16, help="offline requests (128 in, 128 out each)")
    parser.add_argument("--cache", default=os.path.join(os.path.expanduser("~"), ".cache", "kvflow-bench-families"))
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "DIRECTORY"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, directory = args.child
        print(json.dumps(one_model(None if name == "smollm2" else directory, args.requests)))
        return
    rows = []
    for name in args.models:
        directory = os.path.join(args.cache, name)
        if name != "smollm2" and not os.path.isfile(os.path.join(directory, "model.safetensors")):
            write_random_checkpoint(name, directory)
        result = subprocess.run([sys.executable, __file__, "--requests", str(args.requests), "--child", name, directory],
                                capture_output=True, text=True, check=True, cwd=HERE)
        row = json.loads(result.stdout.strip().splitlines()[-1])
        rows.append((name, row))
        print(f"{name}: {json.dumps(row)}", file=sys.stderr)
    print(f"\nbf16, engine defaults, {args.requests} offline requests of 128 + 128 tokens\n")
    print("| model | parameters | weights read per token | TPOT | TTFT (128 tokens) | TPOT / floor | offline tok/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, row in rows:
        low, high = row["floor_ratio_range"]
        print(f"| {name} | {row['parameters'] / 1e6:.0f} M | {row['weight_bytes'] / 1e6:.0f} MB | {row['tpot_ms']:.1f} ms | "
              f"{row['ttft_ms']:.0f} ms | {row['floor_ratio']:.2f}x ({low:.2f}-{high:.2f}) | "
              f"{row['offline_tokens_per_s']:.1f} |")


if __name__ == "__main__":
    main()
