"""Figures of benchmark results, drawn with matplotlib (needed only when plotting)."""

from pathlib import Path

from kvflow.bench.latency_stats import RequestRecord


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError("plotting needs matplotlib: pip install matplotlib") from None
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _save(plt, figure, path: str | Path) -> Path:
    figure.tight_layout()
    path = Path(path)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _plot_cdf(axis, values_ms: list[float], title: str) -> None:
    axis.set_title(title)
    axis.set_xlabel("ms")
    axis.set_ylabel("fraction of samples")
    axis.grid(True, alpha=0.3)
    if not values_ms:
        axis.text(0.5, 0.5, "no data", ha="center", va="center", transform=axis.transAxes)
        return
    ordered = sorted(values_ms)
    fractions = [(rank + 1) / len(ordered) for rank in range(len(ordered))]
    axis.step(ordered, fractions, where="post")
    axis.set_ylim(0, 1.02)


def plot_latency_cdfs(records: list[RequestRecord], path: str | Path) -> Path:
    """The cumulative distributions of TTFT, TPOT, ITL and E2E latency of the completed
    requests, four panels in one PNG."""
    plt = _pyplot()
    completed = [record for record in records if record.success]
    panels = [
        ("Time to first token", [record.ttft * 1000 for record in completed]),
        ("Time per output token", [record.tpot * 1000 for record in completed if record.tpot is not None]),
        ("Inter-token latency", [gap * 1000 for record in completed for gap in record.itls]),
        ("End-to-end latency", [record.e2e_latency * 1000 for record in completed]),
    ]
    figure, axes = plt.subplots(2, 2, figsize=(11, 8))
    for axis, (title, values_ms) in zip(axes.flat, panels):
        _plot_cdf(axis, values_ms, title)
    figure.suptitle(f"Latency CDFs ({len(completed)} completed requests)")
    return _save(plt, figure, path)


def plot_concurrency_sweep(rows: list[dict], path: str | Path) -> Path:
    """Output throughput and TPOT (P99, and P50 where given) against the client concurrency:
    rows of {concurrency, output_throughput, p99_tpot_ms, p50_tpot_ms?}."""
    plt = _pyplot()
    rows = sorted(rows, key=lambda row: row["concurrency"])
    concurrency = [row["concurrency"] for row in rows]
    figure, (throughput_axis, tpot_axis) = plt.subplots(1, 2, figsize=(12, 4.5))

    throughput_axis.plot(concurrency, [row["output_throughput"] for row in rows], marker="o")
    throughput_axis.set_title("Output throughput")
    throughput_axis.set_ylabel("tokens/s")

    tpot_axis.plot(concurrency, [row["p99_tpot_ms"] for row in rows], marker="o", label="P99")
    if all(row.get("p50_tpot_ms") is not None for row in rows):
        tpot_axis.plot(concurrency, [row["p50_tpot_ms"] for row in rows], marker="s", label="P50")
    tpot_axis.set_title("Time per output token")
    tpot_axis.set_ylabel("ms")
    tpot_axis.legend()

    for axis in (throughput_axis, tpot_axis):
        axis.set_xlabel("concurrent requests")
        if concurrency and min(concurrency) > 0:
            axis.set_xscale("log", base=2)  # sweeps usually double the concurrency
            axis.set_xticks(concurrency, [f"{value:g}" for value in concurrency])
            axis.minorticks_off()
        axis.grid(True, alpha=0.3)
    return _save(plt, figure, path)


def plot_ttft_vs_prompt(rows: list[dict], path: str | Path) -> Path:
    """P50 and P99 TTFT against prompt length: rows of {prompt_len, p50_ttft_ms, p99_ttft_ms}."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    lengths = [row["prompt_len"] for row in rows]
    axis.plot(lengths, [row["p50_ttft_ms"] for row in rows], marker="o", label="P50")
    axis.plot(lengths, [row["p99_ttft_ms"] for row in rows], marker="s", label="P99")
    axis.set(xlabel="prompt tokens", ylabel="TTFT (ms)", title="TTFT vs prompt length")
    axis.grid(True, alpha=0.3)
    axis.legend()
    return _save(plt, figure, path)


def plot_e2e_fit(points: list[tuple[int, float]], intercept_ms: float, slope_ms: float, path: str | Path) -> Path:
    """Each request's E2E latency against its output length N, with the fit
    E2E = intercept + slope x (N - 1); points are (N - 1, E2E in seconds)."""
    plt = _pyplot()
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.scatter([x + 1 for x, _ in points], [y * 1000 for _, y in points], s=12, label="requests")
    top = max(x for x, _ in points)
    axis.plot([1, top + 1], [intercept_ms, intercept_ms + slope_ms * top], color="C1",
              label=f"E2E = {intercept_ms:.0f} ms + {slope_ms:.2f} ms x (N-1)")
    axis.set(xlabel="output tokens N", ylabel="E2E (ms)", title="E2E vs output length")
    axis.grid(True, alpha=0.3)
    axis.legend()
    return _save(plt, figure, path)
