"""What splitting a model over ranks costs or gives on this machine: one model step at 1 and at 2
ranks (gloo on the CPU), in turns A B A B, on random weights of a real shape (Llama-3.2-1B's by
default), with the time the ranks spent in all-reduces and all-gathers.

    python benchmarks/bench_tensor_parallel.py [--tp 2] [--rounds 2] [--shape llama-3.2-1b] [--dtype bfloat16]

Per engine: the prefill of one 256-token prompt (TTFT), then the mean decode step at 1 and 8
requests (TPOT). The one-process engine runs twice: as it runs by default (captured CPU programs)
and op by op (--enforce-eager, what every rank runs under tensor parallelism), so that the
all-reduces' share of the difference shows. The checkpoint is written once into --cache
(safetensors, random weights, SmolLM2's tokenizer).
"""

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from kvflow import LLM, SamplingParams

SHAPES = {
    # Llama-3.2-1B: 16 layers, 32 heads, 8 KV heads, tied embeddings
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=49152, tie_word_embeddings=True),
}


def write_checkpoint(directory: Path, shape: dict) -> None:
    """config.json, random bf16 weights and SmolLM2's tokenizer (its ids are all below the vocab)."""
    from transformers import AutoTokenizer

    from kvflow.loader.model_loader import resolve_model_path

    directory.mkdir(parents=True, exist_ok=True)
    config = dict(shape, architectures=["LlamaForCausalLM"], model_type="llama", max_position_embeddings=4096,
                  rms_norm_eps=1e-5, rope_theta=500000.0, hidden_act="silu", bos_token_id=1, eos_token_id=2,
                  torch_dtype="bfloat16")
    (directory / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(0)

    def random(*size):
        return (torch.randn(*size, generator=generator) * 0.02).to(torch.bfloat16)

    h, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    head_dim = h // shape["num_attention_heads"]
    kv = shape["num_key_value_heads"] * head_dim
    tensors = {"model.embed_tokens.weight": random(v, h), "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors.update({p + "self_attn.q_proj.weight": random(h, h), p + "self_attn.k_proj.weight": random(kv, h),
                        p + "self_attn.v_proj.weight": random(kv, h), p + "self_attn.o_proj.weight": random(h, h),
                        p + "mlp.gate_proj.weight": random(f, h), p + "mlp.up_proj.weight": random(f, h),
                        p + "mlp.down_proj.weight": random(h, f),
                        p + "input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                        p + "post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16)})
    save_file(tensors, str(directory / "model.safetensors"))
    path = Path(resolve_model_path(None))
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(directory)


def measure(llm: LLM, prompt_len: int, decode_steps: int) -> dict:
    engine = llm.engine
    prompt = [(7 * i) % 40000 + 3 for i in range(prompt_len)]
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 1, ignore_eos=True)
    start = time.perf_counter()
    engine.add_request("ttft", prompt, SamplingParams(temperature=0, max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    result = {"ttft_ms": (time.perf_counter() - start) * 1e3}
    for batch in (1, 8):
        for i in range(batch):
            engine.add_request(f"d{batch}-{i}", prompt[: 16 + i], params)
        engine.step()  # the prompts
        start = time.perf_counter()
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        result[f"tpot{batch}_ms"] = (time.perf_counter() - start) * 1e3 / steps
    stats = engine.stats()["tensor_parallel"]
    result["collective_s"] = 0.0 if stats is None else stats["collective_seconds"]
    result["collectives"] = 0 if stats is None else stats["all_reduces"] + stats["all_gathers"]
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.2-1b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/kvflow-bench-tp"))
    args = parser.parse_args()
    directory = args.cache / args.shape
    if not (directory / "model.safetensors").exists():
        write_checkpoint(directory, SHAPES[args.shape])
    engines = {"tp1": dict(tensor_parallel_size=1), "tp1-eager": dict(tensor_parallel_size=1, enforce_eager=True),
               f"tp{args.tp}": dict(tensor_parallel_size=args.tp)}
    results = {name: [] for name in engines}
    for round_index in range(args.rounds):
        for name, options in engines.items():
            llm = LLM(model=str(directory), dtype=args.dtype, max_model_len=1024, kv_cache_memory=256 << 20,
                      enable_prefix_caching=False, **options)
            results[name].append(measure(llm, args.prompt_len, args.decode_steps))
            llm.engine.shutdown()
            del llm
            print(f"round {round_index + 1} {name}: {results[name][-1]}", flush=True)
    tp = f"tp{args.tp}"
    print(f"\n{args.shape}, {args.dtype}, median of {args.rounds} rounds")
    for metric in ("ttft_ms", "tpot1_ms", "tpot8_ms"):
        medians = {name: statistics.median(r[metric] for r in runs) for name, runs in results.items()}
        ratios = [b[metric] / a[metric] for a, b in zip(results["tp1"], results[tp])]
        print(f"{metric:9s} " + "  ".join(f"{name} {value:8.1f}" for name, value in medians.items())
              + f"   {tp}/tp1 per round: " + ", ".join(f"{r:.2f}" for r in ratios))
    collective = statistics.median(r["collective_s"] for r in results[tp])
    count = statistics.median(r["collectives"] for r in results[tp])
    print(f"{tp}: {collective:.2f} s in {count:.0f} all-reduces and all-gathers over the whole run (rank 0), "
          f"{collective / count * 1e3:.2f} ms each")


if __name__ == "__main__":
    main()
