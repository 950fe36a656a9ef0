"""What this machine can run: the CPU's features, the instruction set kvflow's CPU kernels use, and
the compute paths that follow from them. Every CPU-dependent choice in kvflow (kernel tables, packed
weight layouts, default dtype, the fused decode paths) asks this one object rather than testing ISA
flags or catching failures where it calls.

The instruction set is the widest this CPU supports, or the one KVFLOW_CPU_ISA names, or the one
force_isa() picks before the first engine; it cannot change while an engine exists. A name the CPU
cannot run is a clear error, never an illegal instruction.
"""

import gc
import os
import weakref
from dataclasses import dataclass

from kvflow import _C

ISAS = ("scalar", "avx2", "avx512", "avx512_bf16")
ISA_VARIABLE = "KVFLOW_CPU_ISA"

# What each kernel table needs of the CPU, in /proc/cpuinfo's names.
ISA_REQUIREMENTS = {
    "scalar": (),
    "avx2": ("avx2", "fma", "f16c"),
    "avx512": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq"),
    "avx512_bf16": ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16"),
}


class CpuIsaError(ValueError):
    """An instruction set this CPU cannot run, an unknown one, or a change while an engine exists."""


@dataclass(frozen=True)
class CpuPlatform:
    model: str                      # the CPU's model name, as /proc/cpuinfo gives it
    features: dict[str, bool]       # avx2, fma, f16c, avx512f/bw/vl/dq, avx512_bf16, avx512_vnni, ...
    supported_isas: tuple[str, ...]  # kernel tables this CPU can run, narrowest first
    isa: str                        # the table in use
    reason: str                     # why that one

    def has(self, feature: str) -> bool:
        return self.features.get(feature, False)

    @property
    def vector_kernels(self) -> bool:
        """Whether the kernels are vectorised (AVX2 or wider) rather than the portable scalar ones."""
        return self.isa != "scalar"

    @property
    def bf16_dot_product(self) -> bool:
        """bf16 products in hardware (vdpbf16ps) rather than widened to float32 in registers."""
        return self.isa == "avx512_bf16"

    @property
    def default_cpu_dtype(self) -> str:
        """The fastest correct dtype on this CPU: bfloat16 where the kernels widen it in registers
        (half the bytes of float32 to stream per token); float32 on the scalar kernels, where every
        bfloat16 value would be converted one at a time."""
        return "bfloat16" if self.vector_kernels else "float32"

    @property
    def torch_onednn_bf16(self) -> bool:
        """Whether torch's oneDNN bf16 ops (mkldnn reorder/linear) run on this CPU. kvflow calls none
        of them; this is reported because other libraries in the same process may."""
        return all(self.has(f) for f in ("avx512bw", "avx512vl", "avx512dq")) or self.has("avx_ne_convert")

    def compute_paths(self) -> dict[str, str]:
        """Which kernel serves each kind of work, for `python -m kvflow env` and bug reports."""
        if self.bf16_dot_product:
            products = "kvflow packed panels, vdpbf16ps (AVX-512 BF16)"
        elif self.vector_kernels:
            products = "kvflow packed panels, bf16 widened to float32 FMA (AVX2)"
        else:
            products = "kvflow packed panels, portable C++ (slow: prefer --dtype float32)"
        few_rows = {"avx512_bf16": "vdpbf16ps", "avx512": "AVX-512 FMA, bf16/fp16 widened",
                    "avx2": "AVX2 FMA, bf16/fp16 widened", "scalar": "portable C++"}[self.isa]
        if not self.vector_kernels:
            quantized = "portable C++"
        elif self.isa.startswith("avx512") and self.has("avx512_vnni"):
            quantized = "AVX-512 VNNI int8 (vpdpbusd, 256-bit)"
        elif self.isa == "avx2" and self.has("avx_vnni"):
            quantized = "AVX-VNNI int8 (vpdpbusd)"
        else:
            quantized = "AVX2 int8 (vpmaddubsw)"
        return {
            "many-row bf16 products (prefill, batched decode)": products,
            "few-row products (decode, LM head)": f"kvflow small_linear, {few_rows}",
            "GGUF quantized weights (kept in their blocks unless --dequantize-weights)":
                f"kvflow quantized_linear on int8 activation blocks, 8 rows interleaved, {quantized}",
            "paged attention": f"kvflow {'AVX-512 BF16' if self.bf16_dot_product else self.isa} kernel",
            "decode step": "a captured program, replayed in one parallel region per step (kvflow CPU executor)",
            "default CPU dtype": self.default_cpu_dtype,
        }


_current: CpuPlatform | None = None
_engines: "weakref.WeakSet" = weakref.WeakSet()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform as system_platform

    return system_platform.processor() or system_platform.machine() or "unknown"


def _detect(reason: str | None = None) -> CpuPlatform:
    supported = tuple(_C.supported_cpu_isas())
    forced = os.environ.get(ISA_VARIABLE, "").strip()
    if forced and reason is None:
        try:
            check_isa(forced)
        except CpuIsaError as error:
            raise CpuIsaError(f"{ISA_VARIABLE}={forced}: {error}") from None
    isa = _C.cpu_isa()  # fixes the table: the widest, or KVFLOW_CPU_ISA's
    if reason is None:
        reason = f"{ISA_VARIABLE}={forced}" if forced else "the widest instruction set this CPU supports"
    return CpuPlatform(model=_cpu_model(), features=dict(_C.cpu_features()), supported_isas=supported, isa=isa,
                       reason=reason)


def current() -> CpuPlatform:
    """This machine's capabilities and the instruction set in use (detected once)."""
    global _current
    if _current is None or _current.isa != _C.cpu_isa():
        _current = _detect(None if _current is None else "set with kvflow.ops.set_cpu_isa")
    return _current


def _live_engines() -> int:
    if len(_engines):
        gc.collect()  # engines hold reference cycles: count only those still reachable
    return len(_engines)


def check_isa(name: str) -> None:
    """Raises CpuIsaError unless `name` is a kernel table this CPU can run."""
    if name not in ISAS:
        raise CpuIsaError(f"unknown CPU instruction set {name!r}; kvflow has: {', '.join(ISAS)}")
    supported = _C.supported_cpu_isas()
    if name not in supported:
        missing = [f for f in ISA_REQUIREMENTS[name] if not dict(_C.cpu_features()).get(f, False)]
        raise CpuIsaError(f"CPU instruction set {name!r} needs {', '.join(missing)}, which this CPU "
                          f"({_cpu_model()}) lacks; it can run: {', '.join(supported)}")


def force_isa(name: str) -> CpuPlatform:
    """Runs every CPU kernel from here on with instruction set `name` (e.g. 'avx2' on an AVX-512
    machine, to run the AVX2 configuration end to end). Only before the first engine, or after the
    last is gone: an engine's weights were prepared for the table it started with."""
    global _current
    check_isa(name)
    if _live_engines():
        raise CpuIsaError(f"cannot switch the CPU instruction set to {name!r} while an engine exists "
                          f"(it runs {_C.cpu_isa()}); set {ISA_VARIABLE} or call force_isa before creating one")
    _C.set_cpu_isa(name)
    _current = _detect(f"forced with kvflow.platform.force_isa({name!r})")
    return _current


def set_batch_invariant(on: bool) -> None:
    """Batch-invariant mode for every CPU kernel of this process (csrc/include/kvflow/cpu/
    batch_invariance.h): one row's results bit-equal whatever the rows beside it, at a cost in
    speed (docs/benchmarks.md). Process-wide, as vLLM's VLLM_BATCH_INVARIANT: it cannot change
    while an engine that started with the other setting exists."""
    on = bool(on)
    if on != _C.batch_invariant() and _live_engines():
        raise ValueError(f"cannot turn batch-invariant mode {'on' if on else 'off'}: an engine in this process runs "
                         f"with it {'on' if not on else 'off'}, and the mode is process-wide")
    _C.set_batch_invariant(on)


def batch_invariant() -> bool:
    return _C.batch_invariant()


def hold(engine) -> CpuPlatform:
    """Registers a new engine, which fixes the instruction set for as long as it lives."""
    platform = current()
    _engines.add(engine)
    return platform
