"""sftrecipes/model/cpumath.py: on a CPU without a bf16 GEMM, bf16 matrix products run on fp32 copies and round to bf16."""

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, launcher_argv
from sftrecipes.model import cpumath
from sftrecipes.core.errors import RecipeError


def test_choice_follows_the_variable_and_the_machine():
    assert cpumath.choice({}) == ("native" if cpumath.native_bf16_gemm() else "fp32")
    assert cpumath.choice({cpumath.MODE_ENV: "native"}) == "native" and cpumath.choice({cpumath.MODE_ENV: "FP32"}) == "fp32"
    with pytest.raises(RecipeError, match=f"^{cpumath.MODE_ENV}='bf17': use one of auto, fp32, native"):
        cpumath.choice({cpumath.MODE_ENV: "bf17"})


PROBE = r"""
import json, sys, time, torch
from sftrecipes.model import cpumath
torch.manual_seed(0)
torch.set_num_threads(1)
a, b = torch.randn(512, 64).bfloat16(), torch.randn(64, 4096).bfloat16()
t = time.perf_counter(); native = a @ b; native_s = time.perf_counter() - t
how = cpumath.apply()
x = a.clone().requires_grad_(); w = torch.randn(4096, 64).bfloat16().requires_grad_()
t = time.perf_counter(); shimmed = a @ b; shim_s = time.perf_counter() - t
y = torch.nn.functional.linear(x, w); y.float().square().sum().backward()
exact = torch.equal(shimmed, (a.float() @ b.float()).bfloat16())
differ = (shimmed != native).float().mean().item()
ulp = ((shimmed.float() - native.float()).abs() / native.float().abs().clamp_min(1e-3)).max().item()
grads = torch.equal(x.grad, ((2 * y.float()).bfloat16().float() @ w.float()).bfloat16())
print(json.dumps({"how": how, "active": cpumath.active(), "exact": exact, "differ": differ, "rel": ulp,
                  "dtypes": [str(shimmed.dtype), str(y.dtype), str(x.grad.dtype)], "grads": grads,
                  "native_s": native_s, "shim_s": shim_s}))
"""


@pytest.mark.parametrize("how", ["fp32", "native"])
def test_bf16_products_in_fp32_are_a_bf16_gemm_rounded_once(how, tmp_path):
    """In a process of its own (the mode stays for a process's life; a fork of the suite's server): with fp32, a bf16 product equals the fp32 product of
    the same operands rounded to bf16, forward and backward (nn.Linear's input gradient), dtypes unchanged, and within
    one bf16 rounding of torch's own kernel; with native, torch's own kernel runs. The two times are printed."""
    import json

    (tmp_path / "probe.py").write_text(PROBE)
    res = subprocess.run([sys.executable, *launcher_argv([str(tmp_path / "probe.py")])], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, cpumath.MODE_ENV: how})
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    print(f"[512,64]x[64,4096] bf16 on {torch.backends.cpu.get_cpu_capability()}: torch's kernel {got['native_s']:.3f}s, "
          f"{how} {got['shim_s']:.3f}s")
    assert got["how"] == how and got["active"] == (how == "fp32")
    assert got["dtypes"] == ["torch.bfloat16"] * 3
    if how == "fp32":
        assert got["exact"] and got["grads"], got
        assert got["differ"] < 0.01 and got["rel"] <= 2 ** -7, got  # another summation order: one bf16 unit at most
    else:
        assert got["differ"] == 0.0, got
