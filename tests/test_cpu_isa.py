"""The CPU instruction set is chosen at run time: the widest this CPU supports, unless
KVFLOW_CPU_ISA or set_cpu_isa picks another."""

import os
import subprocess
import sys

import pytest

from kvflow import ops

PROBE = "import kvflow, torch; kvflow.ops.rms_norm(torch.ones(2, 8), torch.ones(8)); print(kvflow.ops.cpu_isa())"


def run_probe(env_value: str | None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("KVFLOW_CPU_ISA", None)
    if env_value is not None:
        env["KVFLOW_CPU_ISA"] = env_value
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120)


def test_default_is_the_widest_supported_isa():
    result = run_probe(None)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ops.supported_cpu_isas()[-1]


def test_environment_variable_forces_the_scalar_path():
    result = run_probe("scalar")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "scalar"


def test_unknown_isa_in_environment_is_a_clear_error():
    result = run_probe("sse9")
    assert result.returncode != 0
    assert "KVFLOW_CPU_ISA" in result.stderr and "sse9" in result.stderr and "scalar" in result.stderr


def test_set_cpu_isa_rejects_unknown_names():
    with pytest.raises(ValueError, match="'sse9' is not one this CPU supports; choose one of: scalar"):
        ops.set_cpu_isa("sse9")
    assert ops.cpu_isa() in ops.supported_cpu_isas()
