"""paged_attention against what a user would otherwise run, measured in the same run:

- decode: gather each request's K/V through its block table into contiguous tensors, then
  torch.nn.functional.scaled_dot_product_attention (GQA); with --new-tokens N, each request's
  last N tokens are its queries (a speculative verification of N - 1 drafts), causally masked;
- prefill: scaled_dot_product_attention on already-contiguous tensors (causal, GQA).

Also reports the KV bytes paged_attention reads per second, against the machine's best read
bandwidth measured here (a sum over a 512 MB tensor) or, on CUDA, its best copy bandwidth.

    python benchmarks/bench_attention.py                       # CPU, the default grid
    python benchmarks/bench_attention.py --device cuda --num-q-heads 32 --num-kv-heads 8 \
        --head-dim 128 --batch 64 --context 4096
"""

import argparse
import math

import torch
import torch.nn.functional as F

import kvflow
from kvflow import AttentionMetadata, ops
from timing import read_bandwidth, timed, write_markdown


def memory_bandwidth(device: str) -> tuple[float, str]:
    """The best GB/s the machine streams over 10 tries (the limit, so the fraction reported
    against it is conservative): reading (sum) on the CPU, read + write (copy) on CUDA."""
    if device == "cuda":
        x = torch.ones(128 << 20, dtype=torch.float32, device=device)  # 512 MB
        y = torch.empty_like(x)
        best = min(timed(lambda: y.copy_(x), device, 1 if i else 3, 1) for i in range(10))
        return 2 * x.numel() * 4 / best / 1e9, "copy"
    return read_bandwidth(device), "read"


def paged_batch(batch, context, q_len, args, dtype, device):
    """Random caches with shuffled block tables for `batch` requests of `context` tokens, the
    last q_len of them new."""
    blocks_per_seq = -(-context // args.block_size)
    num_blocks = batch * blocks_per_seq
    perm = torch.randperm(num_blocks).tolist()
    tables = [perm[b * blocks_per_seq : (b + 1) * blocks_per_seq] for b in range(batch)]
    shape = (num_blocks, args.block_size, args.num_kv_heads, args.head_dim)
    key_cache = torch.randn(shape, dtype=dtype, device=device)
    value_cache = torch.randn(shape, dtype=dtype, device=device)
    query = torch.randn(batch * q_len, args.num_q_heads, args.head_dim, dtype=dtype, device=device)
    md = AttentionMetadata.build([q_len] * batch, [context] * batch, tables, args.block_size, device)
    return query, key_cache, value_cache, md


def run_paged(query, key_cache, value_cache, md, out):
    scale = 1.0 / math.sqrt(query.shape[-1])
    return ops.paged_attention(query, key_cache, value_cache, md.block_tables, md.cu_seqlens_q, md.seq_lens,
                               scale, md.max_query_len, md.max_seq_len, out=out)


def gather_then_sdpa(query, key_cache, value_cache, md, batch, context, new_tokens):
    """The unfused peer for decode: materialise each request's K/V, then SDPA, query i of the
    last new_tokens seeing the keys up to its own position."""
    num_kv, head_dim = key_cache.shape[2:]
    k = key_cache[md.block_tables.long()].reshape(batch, -1, num_kv, head_dim)[:, :context].transpose(1, 2)
    v = value_cache[md.block_tables.long()].reshape(batch, -1, num_kv, head_dim)[:, :context].transpose(1, 2)
    q = query.view(batch, new_tokens, -1, head_dim).transpose(1, 2)
    positions = torch.arange(context - new_tokens, context, device=query.device)
    visible = torch.arange(context, device=query.device)[None, :] <= positions[:, None]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--num-q-heads", type=int, default=9)
    parser.add_argument("--num-kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--context", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[1],
                        help="query tokens per request in the decode grid (5: four drafts verified)")
    parser.add_argument("--prefill", type=int, nargs="+", default=[128, 512, 1024])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--markdown", default=None, help="also write the tables to this file")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = args.device

    bandwidth, kind = memory_bandwidth(device)
    where = device if device == "cuda" else f"cpu ({ops.cpu_isa()}, {torch.get_num_threads()} threads)"
    lines = [
        f"kvflow {kvflow.__version__} paged_attention, torch {torch.__version__}, {where}, {args.dtype}, "
        f"{args.num_q_heads} q heads / {args.num_kv_heads} kv heads, head_dim {args.head_dim}, "
        f"block_size {args.block_size}",
        f"machine {kind} bandwidth: {bandwidth:.1f} GB/s",
        "",
        "| decode batch x new tokens x context | kvflow (ms) | gather + SDPA (ms) | speedup | KV read GB/s | of machine |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for batch in args.batch:
        for new in args.new_tokens:
            for context in args.context:
                query, key_cache, value_cache, md = paged_batch(batch, context, new, args, dtype, device)
                out = torch.empty_like(query)
                t_ours = timed(lambda: run_paged(query, key_cache, value_cache, md, out), device, 3, args.repeat)
                t_peer = timed(lambda: gather_then_sdpa(query, key_cache, value_cache, md, batch, context, new),
                               device, 1, max(3, args.repeat // 3))
                kv_bytes = 2 * batch * context * args.num_kv_heads * args.head_dim * key_cache.element_size()
                gbs = kv_bytes / t_ours / 1e9
                row = (f"| {batch} x {new} x {context} | {t_ours * 1e3:.3f} | {t_peer * 1e3:.3f} | "
                       f"{t_peer / t_ours:.2f}x | {gbs:.1f} | {gbs / bandwidth:.0%} |")
                lines.append(row)
                print(row, flush=True)

    lines += ["", "| prefill tokens | kvflow (ms) | SDPA contiguous (ms) | speedup |", "|---|---:|---:|---:|"]
    print("\n".join(lines[-3:]), flush=True)
    for length in args.prefill:
        query, key_cache, value_cache, md = paged_batch(1, length, length, args, dtype, device)
        out = torch.empty_like(query)
        q = query.transpose(0, 1).unsqueeze(0)  # [1, heads, tokens, head_dim]
        k = torch.randn(1, args.num_kv_heads, length, args.head_dim, dtype=dtype, device=device)
        v = torch.randn_like(k)
        t_ours = timed(lambda: run_paged(query, key_cache, value_cache, md, out), device, 2, args.repeat)
        t_peer = timed(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True), device, 2,
                       args.repeat)
        row = f"| {length} | {t_ours * 1e3:.2f} | {t_peer * 1e3:.2f} | {t_peer / t_ours:.2f}x |"
        lines.append(row)
        print(row, flush=True)
    write_markdown(args.markdown, lines)


if __name__ == "__main__":
    main()
