"""Per-request timings of a serving benchmark and the summary statistics over them (no I/O)."""

import math
import statistics
from dataclasses import dataclass, field

SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (50, 95, 99)


@dataclass
class RequestRecord:
    """One request as the client saw it. Times are in seconds; start_time is measured from the
    start of the benchmark."""

    prompt_len: int
    output_len: int = 0
    success: bool = False
    error: str = ""
    start_time: float = 0.0
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    e2e_latency: float = 0.0

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first; None when there is only one token."""
        if self.output_len <= 1:
            return None
        return (self.e2e_latency - self.ttft) / (self.output_len - 1)


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile, interpolating linearly between the closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty list")
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is outside [0, 100]")
    ordered = sorted(values)
    rank = p / 100 * (len(ordered) - 1)
    lower = math.floor(rank)
    upper = min(lower + 1, len(ordered) - 1)
    return ordered[lower] + (ordered[upper] - ordered[lower]) * (rank - lower)


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """Whether a completed request met every bound in `slo` (seconds)."""
    if "ttft" in slo and record.ttft > slo["ttft"]:
        return False
    if "tpot" in slo and record.tpot is not None and record.tpot > slo["tpot"]:
        return False
    if "itl" in slo and any(gap > slo["itl"] for gap in record.itls):
        return False
    if "e2e" in slo and record.e2e_latency > slo["e2e"]:
        return False
    return True


def _metric_stats(name: str, values_s: list[float]) -> dict[str, float | None]:
    """mean, std and percentiles of `values_s` in milliseconds; None when there are no values."""
    values_ms = [value * 1000 for value in values_s]
    stats: dict[str, float | None] = {
        f"mean_{name}_ms": statistics.fmean(values_ms) if values_ms else None,
        f"std_{name}_ms": statistics.pstdev(values_ms) if values_ms else None,
    }
    for p in PERCENTILES:
        stats[f"p{p}_{name}_ms"] = percentile(values_ms, p) if values_ms else None
    return stats


def summarize(records: list[RequestRecord], duration_s: float,
              slo: dict[str, float] | None = None) -> dict[str, float | int | None]:
    """Throughput and latency statistics of a run that took `duration_s`. Failed requests are
    counted, but never enter the latency statistics."""
    if duration_s <= 0:
        raise ValueError(f"the benchmark duration must be positive, got {duration_s}")
    completed = [record for record in records if record.success]
    input_tokens = sum(record.prompt_len for record in completed)
    output_tokens = sum(record.output_len for record in completed)
    summary: dict[str, float | int | None] = {
        "completed": len(completed),
        "failed": len(records) - len(completed),
        "duration": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(completed) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    summary.update(_metric_stats("ttft", [record.ttft for record in completed]))
    summary.update(_metric_stats("tpot", [record.tpot for record in completed if record.tpot is not None]))
    summary.update(_metric_stats("itl", [gap for record in completed for gap in record.itls]))
    summary.update(_metric_stats("e2e", [record.e2e_latency for record in completed]))
    if slo:
        unknown = set(slo) - set(SLO_METRICS)
        if unknown:
            raise ValueError(f"unknown SLO metric(s) {sorted(unknown)}; known: {', '.join(SLO_METRICS)}")
        good = sum(meets_slo(record, slo) for record in completed)
        summary["goodput"] = good / duration_s
        summary["slo_attainment"] = good / len(completed) if completed else None
    return summary


def parse_slo(text: str) -> dict[str, float]:
    """'ttft=0.5,tpot=50ms' -> {'ttft': 0.5, 'tpot': 0.05}: bounds in seconds; a number without a
    unit is in seconds."""
    slo: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        key, equals, value = part.partition("=")
        key, value = key.strip(), value.strip().lower()
        if not equals:
            raise ValueError(f"SLO part {part!r} is not metric=value")
        if key not in SLO_METRICS:
            raise ValueError(f"SLO part {part!r}: unknown metric {key!r} (known: {', '.join(SLO_METRICS)})")
        if key in slo:
            raise ValueError(f"SLO part {part!r}: {key} is given twice")
        scale = 1.0
        if value.endswith("ms"):
            value, scale = value[:-2], 1e-3
        elif value.endswith("s"):
            value = value[:-1]
        try:
            seconds = float(value) * scale
        except ValueError:
            raise ValueError(f"SLO part {part!r}: {value!r} is not a number") from None
        if not math.isfinite(seconds) or seconds <= 0:
            raise ValueError(f"SLO part {part!r}: the bound must be a positive finite time")
        slo[key] = seconds
    if not slo:
        raise ValueError(f"no SLO bounds in {text!r}; expected e.g. 'ttft=500ms,tpot=50ms'")
    return slo
