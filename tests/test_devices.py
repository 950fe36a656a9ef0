"""Tensors on different devices are rejected with an error naming the argument. These cases need
a CUDA device, so they exist only where torch sees one (the GPU check runs them)."""

import pytest
import torch

from kvflow import ops

if torch.cuda.is_available():

    def test_mixed_devices_are_rejected():
        x = torch.randn(4, 64, device="cuda")
        with pytest.raises(RuntimeError, match="weight is on cpu but input is on cuda"):
            ops.rms_norm(x, torch.randn(64))
        with pytest.raises(RuntimeError, match="residual is on cpu but input is on cuda"):
            ops.fused_add_rms_norm(x, torch.randn(4, 64), torch.randn(64, device="cuda"))
        with pytest.raises(RuntimeError, match="positions is on cpu but the data is on cuda"):
            ops.rotary_embedding(torch.arange(4), x, None, 64, ops.compute_cos_sin_cache(64, 8, device="cuda"))
        cache = torch.zeros(2, 16, 1, 64, device="cuda")
        with pytest.raises(RuntimeError, match="slot_mapping is on cpu but the data is on cuda"):
            ops.reshape_and_cache(x.view(4, 1, 64), x.view(4, 1, 64), cache, cache.clone(), torch.arange(4))
        with pytest.raises(RuntimeError, match="out is on cpu but input is on cuda"):
            ops.silu_and_mul(x, out=torch.empty(4, 32))
