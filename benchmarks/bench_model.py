"""One request on the embedded default model (or --model): kvflow against Hugging Face
transformers on the same weights, measured in the same run.

- load time: from the file to a model ready to run (kvflow: GGUF read, fill; HF: dequantize and
  fill through from_pretrained(gguf_file=...));
- kvflow with the file's quantized blocks (the default) and with --dequantize-weights;
- TTFT: a 128-token prompt to its first greedy token (the prompt in one forward pass);
- TPOT: the mean time per token over the following 127 greedy tokens (128 in all);
- the machine's floor for decode at batch 1: the bytes of the weights as kvflow holds them,
  divided by the read bandwidth measured here (a sum over a 512 MB tensor). Every decode step
  reads every weight once (the tied embedding once, as the LM head), so no TPOT can beat it;

    python benchmarks/bench_model.py                    # kvflow bf16 + fp32 vs HF fp32 + bf16
    python benchmarks/bench_model.py --markdown docs/bench_model.md
"""

import argparse
import os
import statistics
import time

import torch

from kvflow import LLM, SamplingParams
from kvflow.loader import load_model, resolve_model_path
from timing import read_bandwidth, weights_read_per_token, write_markdown

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def prompt_ids(tokenizer, length: int) -> list[int]:
    text = ("The history of computing is a story of abstractions: from vacuum tubes to transistors, from "
            "machine code to compilers, from batch jobs to time sharing, and from single machines to "
            "warehouse-scale clusters serving billions of requests every day. ")
    ids = tokenizer.encode(text * (length // 20 + 1))
    return ids[:length]


WEIGHTS = {"quantized": False, "dequantized": True}  # -> dequantize_weights

def kvflow_run(model: str | None, dtype: str, prompt_len: int, new_tokens: int, repeat: int,
               dequantize: bool = False) -> dict:
    """One request at a time through the engine (prefix caching off, so every run prefills)."""
    llm = LLM(model, dtype=dtype, enable_prefix_caching=False, kv_cache_memory=64 << 20,
              dequantize_weights=dequantize)
    ids = prompt_ids(llm.tokenizer, prompt_len)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    weight_bytes = weights_read_per_token(llm.engine.runner.model)
    ttfts, tpots, floor_ratios = [], [], []
    # The read bandwidth right before and right after each run, averaged: this VM's bandwidth
    # moves by 1.5x from one minute to the next, so a floor measured once drifts away from the
    # runs it judges, and one measured only before a run misses a change during it.
    bandwidth_before = read_bandwidth("cpu")
    for i in range(repeat + 1):
        metrics = llm.generate([ids], params, use_tqdm=False)[0].metrics
        bandwidth_after = read_bandwidth("cpu")
        if i:  # the first run warms up
            ttfts.append(metrics.ttft)
            tpots.append(metrics.tpot)
            bandwidth = (bandwidth_before + bandwidth_after) / 2
            floor_ratios.append(metrics.tpot / (weight_bytes / (bandwidth * 1e9)))
        bandwidth_before = bandwidth_after
    return {"load": llm.engine.load_seconds, "ttft": statistics.median(ttfts), "tpot": statistics.median(tpots),
            "weight_bytes": weight_bytes, "floor_ratios": floor_ratios}


def hf_run(path: str, dtype: torch.dtype, prompt_len: int, new_tokens: int, repeat: int, tokenizer_ids) -> dict:
    from transformers import AutoModelForCausalLM

    directory, name = os.path.split(path)
    start = time.perf_counter()
    if os.path.isdir(path):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=dtype)
    model.eval()
    load = time.perf_counter() - start
    input_ids = torch.tensor([tokenizer_ids])
    ttfts, totals = [], []
    with torch.inference_mode():
        for i in range(repeat + 1):
            start = time.perf_counter()
            model.generate(input_ids, max_new_tokens=1, do_sample=False)
            ttft = time.perf_counter() - start
            start = time.perf_counter()
            model.generate(input_ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
            total = time.perf_counter() - start
            if i:
                ttfts.append(ttft)
                totals.append(total)
    ttft = statistics.median(ttfts)
    return {"load": load, "ttft": ttft, "tpot": (statistics.median(totals) - ttft) / (new_tokens - 1)}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded model)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--kvflow-dtypes", nargs="+", default=["bfloat16", "float32"], choices=list(DTYPES))
    parser.add_argument("--kvflow-weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS),
                        help="a GGUF file's quantized weights kept in their blocks, or dequantized to the dtype")
    parser.add_argument("--hf-dtypes", nargs="*", default=["float32", "bfloat16"], choices=list(DTYPES))
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    args = parser.parse_args()

    path = resolve_model_path(args.model)
    bandwidth = read_bandwidth("cpu")
    results = {}
    for name in args.kvflow_dtypes:
        for weights in args.kvflow_weights:
            label = f"kvflow {name}, {weights} weights"
            results[label] = kvflow_run(args.model, name, args.prompt_tokens, args.new_tokens, args.repeat,
                                        WEIGHTS[weights])
            print(f"{label}: {results[label]}", flush=True)
    tokenizer = load_model(args.model, torch.bfloat16).tokenizer
    ids = prompt_ids(tokenizer, args.prompt_tokens)
    for name in args.hf_dtypes:
        results[f"HF {name}"] = hf_run(path, DTYPES[name], args.prompt_tokens, args.new_tokens, args.repeat, ids)
        print(f"HF {name}: {results[f'HF {name}']}", flush=True)

    lines = [
        f"{os.path.basename(path)}, one request, {args.prompt_tokens}-token prompt, {args.new_tokens} greedy tokens; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; read bandwidth {bandwidth:.1f} GB/s",
        "",
        "| engine | load (s) | TTFT (ms) | TPOT (ms) | tokens/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        lines.append(f"| {name} | {r['load']:.2f} | {r['ttft'] * 1e3:.1f} | {r['tpot'] * 1e3:.2f} | "
                     f"{1 / r['tpot']:.1f} |")
    for name, ours in results.items():
        if "floor_ratios" not in ours:
            continue
        floor = ours["weight_bytes"] / (bandwidth * 1e9)
        ratios = ours["floor_ratios"]
        lines += ["", f"{name}: decode floor {ours['weight_bytes'] / 1e6:.0f} MB of weights / {bandwidth:.1f} GB/s = "
                      f"{floor * 1e3:.2f} ms; TPOT = {ours['tpot'] / floor:.2f}x the floor; each run against the "
                      f"mean of the bandwidths measured just before and after it: {statistics.median(ratios):.2f}x "
                      f"(median of {len(ratios)}; {min(ratios):.2f}-{max(ratios):.2f})"]
    quantized, dequantized = results.get("kvflow bfloat16, quantized weights"), results.get("kvflow bfloat16, dequantized weights")
    if quantized and dequantized:
        lines.append(f"bf16, quantized vs dequantized weights: TPOT {quantized['tpot'] / dequantized['tpot']:.2f}x, "
                     f"TTFT {quantized['ttft'] / dequantized['ttft']:.2f}x")
    if quantized and "HF float32" in results:
        hf = results["HF float32"]
        lines.append(f"kvflow bf16 (quantized weights) vs HF float32: TPOT {quantized['tpot'] / hf['tpot']:.2f}x, "
                     f"TTFT {quantized['ttft'] / hf['ttft']:.2f}x, load {quantized['load'] / hf['load']:.2f}x")
    print("\n" + "\n".join(lines))
    write_markdown(args.markdown, lines)


if __name__ == "__main__":
    main()
