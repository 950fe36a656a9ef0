"""kvflow's sampler against the torch code a user would write (softmax, sort, cumsum, mask,
multinomial), measured in the same run, over a batch x vocabulary grid.

    python benchmarks/bench_sampling.py                      # CPU, batch 1 / 64, vocab 49152 / 128256 / 262144
    python benchmarks/bench_sampling.py --device cuda --batch 128 --vocab 128256
"""

import argparse

import torch

import kvflow
from kvflow import ops
from timing import timed, write_markdown


def torch_sample(logits, temperature, top_k, top_p, generator):
    """The usual eager recipe (as in Hugging Face's TopK/TopP logits warpers), per-row parameters."""
    logits = logits.float() / temperature[:, None]
    sorted_logits, sorted_idx = torch.sort(logits, descending=True, dim=-1)
    ranks = torch.arange(logits.shape[-1], device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = sorted_logits.softmax(-1)
    cumulative = probs.cumsum(-1)
    sorted_logits = sorted_logits.masked_fill(cumulative - probs > top_p[:, None], float("-inf"))
    choice = torch.multinomial(sorted_logits.softmax(-1), 1, generator=generator)
    return sorted_idx.gather(-1, choice)[:, 0]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--vocab", type=int, nargs="+", default=[49152, 128256, 262144])
    parser.add_argument("--top-k", type=int, default=50)
    parser.add_argument("--top-p", type=float, default=0.9)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    device = args.device
    where = device if device == "cuda" else f"cpu ({ops.cpu_isa()}, {torch.get_num_threads()} threads)"
    lines = [
        f"kvflow {kvflow.__version__} sampling, torch {torch.__version__}, {where}, float32 logits, "
        f"temperature 0.8, top_k {args.top_k}, top_p {args.top_p}",
        "",
        "| batch x vocab | kvflow (ms) | torch sort + multinomial (ms) | speedup | kvflow, top_p only (ms) |",
        "|---|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    generator = torch.Generator(device=device).manual_seed(0)
    for batch in args.batch:
        for vocab in args.vocab:
            logits = torch.randn(batch, vocab, device=device) * 3
            temperature = torch.full((batch,), 0.8, device=device)
            top_k = torch.full((batch,), args.top_k, dtype=torch.int32, device=device)
            no_top_k = torch.zeros(batch, dtype=torch.int32, device=device)
            top_p = torch.full((batch,), args.top_p, device=device)
            min_p = torch.zeros(batch, device=device)
            seeds = torch.arange(batch, device=device)
            offsets = torch.zeros(batch, dtype=torch.int64, device=device)
            t_ours = timed(lambda: ops.sample(logits, temperature, top_k, top_p, min_p, seeds, offsets), device,
                           repeat=args.repeat)
            t_top_p = timed(lambda: ops.sample(logits, temperature, no_top_k, top_p, min_p, seeds, offsets), device,
                            repeat=args.repeat)
            t_torch = timed(lambda: torch_sample(logits, temperature, top_k, top_p, generator), device,
                            repeat=args.repeat)
            row = (f"| {batch} x {vocab} | {t_ours * 1e3:.3f} | {t_torch * 1e3:.3f} | {t_torch / t_ours:.1f}x | "
                   f"{t_top_p * 1e3:.3f} |")
            lines.append(row)
            print(row, flush=True)
    write_markdown(args.markdown, lines)


if __name__ == "__main__":
    main()
