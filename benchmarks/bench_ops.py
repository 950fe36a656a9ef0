"""Microbenchmarks of kvflow's core ops against the eager PyTorch composite a user would
otherwise write (the same lines as Hugging Face transformers' LlamaRMSNorm.forward,
apply_rotary_pos_emb and act_fn(gate) * up), measured in the same run.

    python benchmarks/bench_ops.py                          # CPU, bfloat16, default grid
    python benchmarks/bench_ops.py --device cuda --tokens 1 256 4096
    python benchmarks/bench_ops.py --markdown docs/ops.md   # also write the table

Each row: median time of kvflow and of the composite, kvflow's achieved bandwidth (bytes the op
must read and write / time), and the speedup (composite time / kvflow time).
"""

import argparse

import numpy as np
import torch
import torch.nn.functional as F

import kvflow
from kvflow import ops, platform
from kvflow.ops.quantized import (BLOCK_BYTES, BLOCK_VALUES, GGML_Q4_0, GGML_Q4_1, GGML_Q4_K, GGML_Q5_0, GGML_Q5_1,
                                  GGML_Q5_K, GGML_Q6_K, GGML_Q8_0, GGML_TYPE_NAMES, INTERLEAVED_TYPES, interleave_rows,
                                  quantized_row_bytes)
from timing import read_bandwidth, timed, write_markdown


def copy_bandwidth(device: str, nbytes: int = 256 << 20) -> float:
    """The machine's measured limit for a streaming op: GB/s of dst.copy_(src) on a buffer far
    larger than the caches (bytes read + bytes written)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    seconds = timed(lambda: dst.copy_(src), device, warmup=2, repeat=10)
    return 2 * nbytes / seconds / 1e9


# --- the eager composites (Hugging Face transformers' formulations) -------------------------


def hf_rms_norm(hidden_states, weight, eps):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


def hf_add_rms_norm(x, residual, weight, eps):
    residual = x + residual
    return hf_rms_norm(residual, weight, eps), residual


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def hf_rotary(q, k, cos_table, sin_table, positions):
    cos = cos_table[positions].unsqueeze(1)  # [tokens, 1, head_dim]
    sin = sin_table[positions].unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def hf_silu_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def hf_gelu_tanh_and_mul(x):
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


# --- one case per op ------------------------------------------------------------------------


def cases(num_tokens: int, hidden: int, num_heads: int, head_dim: int, dtype, device):
    """Yields (op, shape, bytes moved, kvflow fn, composite fn)."""
    esize = torch.empty((), dtype=dtype).element_size()
    x = torch.randn(num_tokens, hidden, dtype=dtype, device=device)
    residual = torch.randn_like(x)
    weight = torch.randn(hidden, dtype=dtype, device=device)
    out = torch.empty_like(x)
    shape = f"{num_tokens}x{hidden}"
    yield ("rms_norm", shape, 2 * x.numel() * esize,
           lambda: ops.rms_norm(x, weight, 1e-6, out=out), lambda: hf_rms_norm(x, weight, 1e-6))
    yield ("fused_add_rms_norm", shape, 4 * x.numel() * esize,
           lambda: ops.fused_add_rms_norm(x, residual, weight, 1e-6),
           lambda: hf_add_rms_norm(x, residual, weight, 1e-6))

    gate_up = torch.randn(num_tokens, 2 * hidden, dtype=dtype, device=device)
    act_out = torch.empty(num_tokens, hidden, dtype=dtype, device=device)
    yield ("silu_and_mul", f"{num_tokens}x{hidden}", 3 * act_out.numel() * esize,
           lambda: ops.silu_and_mul(gate_up, out=act_out), lambda: hf_silu_and_mul(gate_up))
    yield ("gelu_tanh_and_mul", f"{num_tokens}x{hidden}", 3 * act_out.numel() * esize,
           lambda: ops.gelu_tanh_and_mul(gate_up, out=act_out), lambda: hf_gelu_tanh_and_mul(gate_up))

    q = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    k = torch.randn(num_tokens, num_heads, head_dim, dtype=dtype, device=device)
    positions = torch.randint(0, 4096, (num_tokens,), device=device)
    cos_sin = ops.compute_cos_sin_cache(head_dim, 4096, device=device)
    cos_half, sin_half = cos_sin.chunk(2, dim=-1)
    cos_table = torch.cat([cos_half, cos_half], -1).to(dtype)
    sin_table = torch.cat([sin_half, sin_half], -1).to(dtype)
    yield ("rotary_embedding", f"{num_tokens}x{num_heads}x{head_dim} q+k", 4 * q.numel() * esize,
           lambda: ops.rotary_embedding(positions, q, k, head_dim, cos_sin, True),
           lambda: hf_rotary(q, k, cos_table, sin_table, positions))

    block_size, num_kv = 16, max(num_heads // 4, 1)
    kv = torch.randn(num_tokens, num_kv, head_dim, dtype=dtype, device=device)
    num_blocks = (num_tokens + block_size - 1) // block_size * 2
    key_cache = torch.zeros(num_blocks, block_size, num_kv, head_dim, dtype=dtype, device=device)
    value_cache = torch.zeros_like(key_cache)
    slots = torch.randperm(num_blocks * block_size, device=device)[:num_tokens]

    def torch_cache_write():
        key_cache.view(-1, num_kv, head_dim)[slots] = kv
        value_cache.view(-1, num_kv, head_dim)[slots] = kv

    yield ("reshape_and_cache", f"{num_tokens}x{num_kv}x{head_dim} k+v", 4 * kv.numel() * esize,
           lambda: ops.reshape_and_cache(kv, kv, key_cache, value_cache, slots), torch_cache_write)


def small_linear_table(dtype, device, rows_grid, shapes, repeat, in_cache=False) -> list[str]:
    """small_linear against torch.nn.functional.linear: decode's few-row products, bound by
    reading the weights, so achieved GB/s is compared with the machine's read bandwidth. Each
    timed pass runs over enough copies of the weight (>= 256 MB) that they come from memory, not
    from cache, as a model's layers do. With in_cache, one copy is read again and again: the
    kernel's arithmetic rate, the headroom it leaves over memory."""
    bandwidth = read_bandwidth(device)
    where = "from cache (one copy)" if in_cache else "from memory"
    lines = [
        "",
        f"small_linear, weights read once per call, {where}; machine read bandwidth {bandwidth:.1f} GB/s",
        "",
        "| rows x in -> out | kvflow (us) | F.linear (us) | speedup | weight GB/s | of machine |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for in_features, out_features in shapes:
        weight_bytes = out_features * in_features * torch.empty((), dtype=dtype).element_size()
        copies = 1 if in_cache else -(-(256 << 20) // weight_bytes)
        weights = [torch.randn(out_features, in_features, dtype=dtype, device=device) for _ in range(copies)]
        for rows in rows_grid:
            x = torch.randn(rows, in_features, dtype=dtype, device=device)
            out = torch.empty(rows, out_features, dtype=dtype, device=device)

            def ours():
                for weight in weights:
                    ops.small_linear(x, weight, out=out)

            def theirs():
                for weight in weights:
                    F.linear(x, weight)

            t_ours = timed(ours, device, 1, max(3, repeat // 10)) / copies
            t_torch = timed(theirs, device, 1, max(3, repeat // 10)) / copies
            gbs = weight_bytes / t_ours / 1e9
            lines.append(f"| {rows} x {in_features} -> {out_features} | {t_ours * 1e6:.1f} | {t_torch * 1e6:.1f} | "
                         f"{t_torch / t_ours:.2f}x | {gbs:.1f} | {gbs / bandwidth:.0%} |")
        del weights
    return lines


# Where each type's float16 scales sit in its block: d (and m or dmin) first, Q6_K's d last.
SCALE_BYTES = {GGML_Q4_0: (0, 2), GGML_Q4_1: (0, 4), GGML_Q5_0: (0, 2), GGML_Q5_1: (0, 4), GGML_Q8_0: (0, 2),
               GGML_Q4_K: (0, 4), GGML_Q5_K: (0, 4), GGML_Q6_K: (208, 210)}
QUANTIZED_TABLE_TYPES = (GGML_Q8_0, GGML_Q6_K, GGML_Q5_K, GGML_Q4_K, GGML_Q4_1, GGML_Q4_0)


def random_gguf_blocks(ggml_type: int, out_features: int, in_features: int, rng) -> torch.Tensor:
    """uint8 [out_features, row bytes] of random blocks: real scales, any codes (the time does not
    depend on the values)."""
    blocks = out_features * in_features // BLOCK_VALUES[ggml_type]
    data = rng.integers(0, 256, (blocks, BLOCK_BYTES[ggml_type]), dtype=np.uint8)
    first, last = SCALE_BYTES[ggml_type]
    scales = rng.uniform(0.0005, 0.01, (blocks, (last - first) // 2)).astype(np.float16)
    data[:, first:last] = scales.view(np.uint8)
    return torch.from_numpy(data.reshape(out_features, -1))


def quantized_linear_table(rows_grid, shapes, repeat, device="cpu") -> list[str]:
    """quantized_linear on GGUF blocks (QUANTIZED_TABLE_TYPES; the K-quants where in_features is
    whole 256-blocks) against the bfloat16 product of the same shape (small_linear on the CPU,
    torch's F.linear on CUDA), weights from memory as in small_linear_table: the time of
    decode's products, and the bytes each reads."""
    bandwidth = read_bandwidth(device)
    names = [GGML_TYPE_NAMES[t] for t in QUANTIZED_TABLE_TYPES]
    peer = "small_linear" if device == "cpu" else "F.linear"
    lines = [
        "",
        f"quantized_linear on {device}, weights from memory; read bandwidth {bandwidth:.1f} GB/s; "
        f"speedup = bf16 {peer} time / this time, same run",
        "",
        "| rows x in -> out | bf16 (us) | " + " | ".join(f"{n} (us) | GB/s | speedup" for n in names) + " |",
        "|---|---:|" + "---:|---:|---:|" * len(names),
    ]
    print("\n".join(lines), flush=True)
    rng = np.random.default_rng(0)
    # Enough copies of each weight that a pass reads well past the last-level cache (60 MB on an H200).
    pass_bytes = (256 if device == "cpu" else 1024) << 20
    for in_features, out_features in shapes:
        def copies_of(make, nbytes):
            first = make()
            return [first] + [first.clone() for _ in range(-(-pass_bytes // nbytes) - 1)]

        bf16 = copies_of(lambda: torch.randn(out_features, in_features, dtype=torch.bfloat16, device=device),
                         out_features * in_features * 2)
        quantized = {t: copies_of(lambda t=t: random_gguf_blocks(t, out_features, in_features, rng).to(device),
                                  quantized_row_bytes(in_features, t) * out_features)
                     for t in QUANTIZED_TABLE_TYPES if in_features % BLOCK_VALUES[t] == 0}
        for rows in rows_grid:
            x = torch.randn(rows, in_features, dtype=torch.bfloat16, device=device)
            out = torch.empty(rows, out_features, dtype=torch.bfloat16, device=device)

            def run_bf16():
                for weight in bf16:
                    if device == "cpu":
                        ops.small_linear(x, weight, out=out)
                    else:
                        torch.nn.functional.linear(x, weight)

            t_bf16 = timed(run_bf16, device, 1, max(3, repeat // 10)) / len(bf16)
            line = f"| {rows} x {in_features} -> {out_features} | {t_bf16 * 1e6:.1f} |"
            for ggml_type in QUANTIZED_TABLE_TYPES:
                if ggml_type not in quantized:
                    line += " - | - | - |"
                    continue

                def run(weights=quantized[ggml_type], ggml_type=ggml_type):
                    for weight in weights:
                        ops.quantized_linear(x, weight, ggml_type, out=out)

                t = timed(run, device, 1, max(3, repeat // 10)) / len(quantized[ggml_type])
                line += f" {t * 1e6:.1f} | {quantized[ggml_type][0].numel() / t / 1e9:.1f} | {t_bf16 / t:.2f}x |"
            lines.append(line)
            print(line, flush=True)
        del bf16, quantized
    return lines


def interleaved_table(rows_grid, shapes, repeat) -> list[str]:
    """quantized_linear on the CPU on each interleavable type (INTERLEAVED_TYPES) in GGUF's layout
    and in kvflow's interleaved layout, weights from memory, bfloat16 input: from 32 rows the GGUF
    layout takes the dequantized panels, the interleaved one its int8 kernel at every count. A type
    whose block does not divide in_features (Q4_K's 256 against 576) shows "-"."""
    names = [GGML_TYPE_NAMES[t] for t in INTERLEAVED_TYPES]
    lines = ["", "quantized_linear on cpu, GGUF layout against interleaved (speedup = GGUF time / interleaved "
             "time), weights from memory, same run", "",
             "| rows x in -> out | " + " | ".join(f"{n} GGUF (us) | {n} interleaved (us) | speedup" for n in names)
             + " |", "|---|" + "---:|---:|---:|" * len(names)]
    print("\n".join(lines), flush=True)
    rng = np.random.default_rng(0)
    for in_features, out_features in shapes:
        layouts = {}
        for ggml_type, layout in INTERLEAVED_TYPES.items():
            if in_features % BLOCK_VALUES[ggml_type]:
                layouts[ggml_type] = None
                continue
            first = random_gguf_blocks(ggml_type, out_features, in_features, rng)
            nbytes = first.numel()
            copies = [first] + [first.clone() for _ in range(-(-(256 << 20) // nbytes) - 1)]
            layouts[ggml_type] = [(copies, ggml_type), ([interleave_rows(c, ggml_type) for c in copies], layout)]
        for rows in rows_grid:
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)
            out = torch.empty(rows, out_features, dtype=torch.bfloat16)
            line = f"| {rows} x {in_features} -> {out_features} |"
            for pair in layouts.values():
                if pair is None:
                    line += " - | - | - |"
                    continue
                times = []
                for weights, type_id in pair:
                    def run(weights=weights, type_id=type_id):
                        for weight in weights:
                            ops.quantized_linear(x, weight, type_id, out=out)

                    times.append(timed(run, "cpu", 1, max(3, repeat // 10)) / len(weights))
                line += f" {times[0] * 1e6:.1f} | {times[1] * 1e6:.1f} | {times[0] / times[1]:.2f}x |"
            lines.append(line)
            print(line, flush=True)
        del layouts
    return lines


def packed_linear_table(rows_grid, shapes, repeat) -> list[str]:
    """packed_linear against torch's matmul on the same products, bfloat16: prefill's and batched
    decode's many-row products, bound by arithmetic, so compared in GFLOP/s. The peers are
    F.linear and oneDNN's matmul on a weight prepacked for the batch size (torch.ops.mkldnn,
    what torch.compile's CPU backend and IPEX use). Each pass runs over every copy of a model's
    worth of weights (>= 200 MB), so that they come from memory, as a model's layers do."""
    lines = ["", "packed_linear, bfloat16 weights from memory: GFLOP/s (time per product)", "",
             "| rows x in -> out | kvflow | oneDNN prepacked | F.linear | F.linear float32 | vs oneDNN | vs float32 |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    for in_features, out_features in shapes:
        copies = max(1, -(-(200 << 20) // (2 * in_features * out_features)))
        weights = [torch.randn(out_features, in_features, dtype=torch.bfloat16) for _ in range(copies)]
        ours = [ops.pack_linear_weight(w) for w in weights]
        for rows in rows_grid:
            onednn = ([torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]
                      if platform.current().torch_onednn_bf16 and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                      else None)  # oneDNN's bf16 path needs AVX-512 (or AVX-NE-CONVERT)
            x = torch.randn(rows, in_features, dtype=torch.bfloat16)
            out = torch.empty(rows, out_features, dtype=torch.bfloat16)
            flops = 2 * rows * in_features * out_features
            runs = max(2, min(repeat // 10, int(2e10 // (flops * copies)) + 1))

            def run_ours():
                for packed in ours:
                    ops.packed_linear(x, packed, out_features, out=out)

            def run_onednn():
                for packed in onednn:
                    torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

            def run_torch():
                for w in weights:
                    F.linear(x, w)

            weights32 = [w.float() for w in weights[:max(1, copies // 2)]]  # the same bytes from memory
            x32 = x.float()

            def run_float32():
                for w in weights32:
                    F.linear(x32, w)

            t_ours = timed(run_ours, "cpu", 1, runs) / copies
            t_torch = timed(run_torch, "cpu", 1, runs) / copies
            t_onednn = timed(run_onednn, "cpu", 1, runs) / copies if onednn is not None else float("nan")
            t_float32 = timed(run_float32, "cpu", 1, runs) / len(weights32)
            del weights32
            gf = lambda t: f"{flops / t / 1e9:.0f} ({t * 1e6:.0f} us)"  # noqa: E731
            lines.append(f"| {rows} x {in_features} -> {out_features} | {gf(t_ours)} | {gf(t_onednn)} | "
                         f"{gf(t_torch)} | {gf(t_float32)} | {t_onednn / t_ours:.2f}x | {t_float32 / t_ours:.2f}x |")
            print(lines[-1], flush=True)
        del weights, ours
    return lines



def packed_silu_table(rows_grid, in_features, d, repeat) -> list[str]:
    """A gated MLP's first half, silu(x @ gate.T) * (x @ up.T), bfloat16, weights from memory:
    packed_silu_and_mul (the activation in the product's epilogue) against packed_linear's gate|up
    product followed by silu_and_mul, which writes the [rows, 2d] product and reads it back."""
    lines = ["", f"packed_silu_and_mul, {in_features} -> 2 x {d}, bfloat16 weights from memory: time per call", "",
             "| rows | packed_silu_and_mul (us) | packed_linear + silu_and_mul (us) | speedup |",
             "|---:|---:|---:|---:|"]
    print("\n".join(lines), flush=True)
    copies = max(1, -(-(200 << 20) // (4 * in_features * d)))
    weights = [torch.randn(2 * d, in_features, dtype=torch.bfloat16) / in_features**0.5 for _ in range(copies)]
    fused = [ops.pack_linear_weight(w, gate_up=True) for w in weights]
    plain = [ops.pack_linear_weight(w) for w in weights]
    for rows in rows_grid:
        x = torch.randn(rows, in_features, dtype=torch.bfloat16)
        out = torch.empty(rows, d, dtype=torch.bfloat16)
        gate_up = torch.empty(rows, 2 * d, dtype=torch.bfloat16)
        runs = max(2, min(repeat // 10, int(2e10 // (4 * rows * in_features * d * copies)) + 1))

        def run_fused():
            for packed in fused:
                ops.packed_silu_and_mul(x, packed, d, out=out)

        def run_plain():
            for packed in plain:
                ops.packed_linear(x, packed, 2 * d, out=gate_up)
                torch.ops.kvflow.silu_and_mul(out, gate_up)

        t_fused = timed(run_fused, "cpu", 1, runs) / copies
        t_plain = timed(run_plain, "cpu", 1, runs) / copies
        lines.append(f"| {rows} | {t_fused * 1e6:.0f} | {t_plain * 1e6:.0f} | {t_plain / t_fused:.2f}x |")
        print(lines[-1], flush=True)
    return lines

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 256, 1024])
    parser.add_argument("--hidden", type=int, nargs="+", default=[2048])
    parser.add_argument("--heads", type=int, default=16, help="query (and key) heads for rotary_embedding")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--ops", nargs="*", default=None, help="only these ops")
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeat", type=int, default=50)
    parser.add_argument("--linear-rows", type=int, nargs="*", default=[1, 2, 4, 8],
                        help="rows for the small_linear table (CPU only; empty to skip)")
    parser.add_argument("--linear-in-cache", action="store_true",
                        help="small_linear on one weight kept in cache instead of copies from memory")
    parser.add_argument("--packed-rows", type=int, nargs="*", default=[16, 64, 256, 2048],
                        help="rows for the packed_linear table (CPU, bfloat16 only; empty to skip)")
    parser.add_argument("--quantized-rows", type=int, nargs="*", default=[1, 4],
                        help="rows for the quantized_linear table (empty to skip)")
    parser.add_argument("--interleaved-rows", type=int, nargs="*", default=[1, 2, 5, 16, 64],
                        help="rows for the GGUF against interleaved layout table (CPU only; empty to skip)")
    parser.add_argument("--markdown", default=None, help="also write the table to this file")
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    where = args.device if args.device == "cuda" else f"cpu ({ops.cpu_isa()}, {torch.get_num_threads()} threads)"
    header = [
        f"kvflow {kvflow.__version__} op benchmark, torch {torch.__version__}, {where}, {args.dtype}",
        f"machine copy bandwidth (256 MB buffer, read + write): {copy_bandwidth(args.device):.1f} GB/s; "
        "shapes below mostly fit in cache, so GB/s can exceed it",
        "",
        "| op | shape | kvflow (us) | torch composite (us) | kvflow GB/s | speedup |",
        "|---|---|---:|---:|---:|---:|",
    ]
    print("\n".join(header), flush=True)
    rows = []
    for hidden in args.hidden:
        for num_tokens in args.tokens:
            for name, shape, nbytes, ours, theirs in cases(num_tokens, hidden, args.heads, args.head_dim, dtype,
                                                          args.device):
                if args.ops and name not in args.ops:
                    continue
                t_ours = timed(ours, args.device, args.warmup, args.repeat)
                t_theirs = timed(theirs, args.device, args.warmup, args.repeat)
                row = (f"| {name} | {shape} | {t_ours * 1e6:.1f} | {t_theirs * 1e6:.1f} | "
                       f"{nbytes / t_ours / 1e9:.1f} | {t_theirs / t_ours:.2f}x |")
                rows.append(row)
                print(row, flush=True)
    if args.device == "cpu" and args.linear_rows and not args.ops:
        # SmolLM2-135M's projections: qkv, o, gate|up, down, and the LM head.
        shapes = [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)]
        linear_lines = small_linear_table(dtype, args.device, args.linear_rows, shapes, args.repeat,
                                          args.linear_in_cache)
        print("\n".join(linear_lines), flush=True)
        rows += linear_lines
    if args.device == "cpu" and args.packed_rows and not args.ops and dtype == torch.bfloat16:
        rows += packed_linear_table(args.packed_rows, [(576, 960), (576, 3072), (1536, 576), (576, 49152)],
                                    args.repeat)
        rows += packed_silu_table(args.packed_rows, 576, 1536, args.repeat)
    if args.quantized_rows and not args.ops:
        # SmolLM2-135M's gate|up and LM head, Qwen2.5-1.5B's gate|up, a Llama-3-8B-sized MLP product.
        shapes = [(576, 3072), (576, 49152), (1536, 8960), (4096, 14336)]
        rows += quantized_linear_table(args.quantized_rows, shapes if args.device == "cpu" else shapes[2:],
                                       args.repeat, args.device)
    if args.device == "cpu" and args.interleaved_rows and not args.ops:
        # SmolLM2-135M's gate|up, down and LM head (tied to the embedding); Qwen2.5-1.5B's gate|up
        # and a Llama-3-8B-sized MLP product, whose rows are whole K-quant blocks.
        rows += interleaved_table(args.interleaved_rows,
                                  [(576, 3072), (1536, 576), (576, 49152), (1536, 8960), (4096, 14336)], args.repeat)
    write_markdown(args.markdown, header + rows)


if __name__ == "__main__":
    main()
