"""The latency experiments: the least-squares fit against hand-computed lines, and one quick run
of `python -m kvflow bench experiments` end to end (server, three sweeps, report, plots)."""

import json
import subprocess
import sys

import pytest

from kvflow.bench.experiments import fit_line


def test_fit_line_recovers_a_line_and_its_least_squares_fit():
    assert fit_line([0, 1, 2, 3], [5, 7, 9, 11]) == pytest.approx((5.0, 2.0))
    # means (1, 2): slope = sum((x-1)(y-2)) / sum((x-1)^2) = (1 + 0 + 0) / 2 = 0.5; intercept 2 - 0.5 = 1.5
    assert fit_line([0, 1, 2], [1, 3, 2]) == pytest.approx((1.5, 0.5))
    with pytest.raises(ValueError, match="two distinct"):
        fit_line([3, 3], [1, 2])


def test_quick_experiments_write_a_report(tmp_path):
    out = tmp_path / "experiments"
    result = subprocess.run([sys.executable, "-m", "kvflow", "bench", "experiments", "--out", str(out), "--quick",
                             "--no-hf", "--kv-cache-memory", "64MiB", "--max-model-len", "1024"],
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = (out / "report.md").read_text()
    for heading in ("## 1. TTFT against prompt length", "## 2. E2E against output length", "## 3. Concurrency",
                    "## 4. Hugging Face one at a time vs kvflow continuous batching"):
        assert heading in report
    results = json.loads((out / "results.json").read_text())
    assert [row["prompt_len"] for row in results["prompt_sweep"]] == [16, 128]
    assert all(row["prompt_len_min"] == row["prompt_len_max"] == row["prompt_len"] for row in results["prompt_sweep"])
    assert [row["concurrency"] for row in results["concurrency_sweep"]] == [1, 4]
    assert all(row["completed"] == row["requests"] and row["failed"] == 0 for row in results["concurrency_sweep"])
    assert results["output_sweep"]["fit_tpot_ms"] > 0
    assert results["hf_vs_kvflow"]["kvflow"]["completed"] == 4
    for png in ("exp1_ttft_vs_prompt.png", "exp2_e2e_vs_output.png", "exp3_concurrency.png", "exp3_latency_cdfs.png"):
        assert (out / png).stat().st_size > 1000
