"""bf16 matrix products on a CPU without a native bf16 GEMM (x86 below AVX-512: AVX2 machines, this project's own).

There torch's bf16 matmul falls back to a scalar kernel: measured on an AVX2 EPYC, one thread, a [512, 64] x [64, 32768]
product took 5.0 s in bf16 and 0.15 s as fp32 (tests/model/test_cpumath.py prints both on the machine it runs on). A CPU twin
computes in bf16 as its GPU recipe does (bf16: true, QLoRA's bf16 compute dtype), so its steps spent most of their time
there. On such a CPU every bf16 matrix product of a run (mm, bmm, addmm, baddbmm, addbmm, mv, addmv, dot; forward and
backward, through nn.Linear, attention and the LM head) is computed from fp32 copies of its bf16 operands and rounded to
bf16: what a bf16 GEMM computes (bf16 inputs, fp32 accumulation, a bf16 result), in another summation order (a few
elements in 10^5 differ by one bf16 unit). Everything else stays as it was: dtypes, memory layout, autograd.

SFTRECIPES_CPU_BF16_MATMUL: auto (default: fp32 where torch's CPU capability is below AVX512 on x86), fp32, native.
Applied in each process of the cpu target whose run multiplies bf16 tensors (train/args.apply_process_env,
computes_in_bf16: the mode sees every op of the process, a few microseconds each, so an fp32 run goes without it); the
run's log says which.
"""

from __future__ import annotations

import logging
import os
import platform

log = logging.getLogger("sftrecipes")

MODE_ENV = "SFTRECIPES_CPU_BF16_MATMUL"
CHOICES = ("auto", "fp32", "native")
_active: list = []  # the mode pushed in this process (once)


def native_bf16_gemm() -> bool:
    """Whether torch's CPU kernels have a vectorized bf16 GEMM here: x86 from AVX512 up (oneDNN), and other machines
    (left as they are: their bf16 paths are their own)."""
    import torch

    if platform.machine().lower() not in ("x86_64", "amd64", "i686", "x86"):
        return True
    return torch.backends.cpu.get_cpu_capability() not in ("DEFAULT", "NO AVX", "AVX2")


def choice(environ=os.environ) -> str:
    """'fp32' or 'native' for this process, from SFTRECIPES_CPU_BF16_MATMUL and the machine."""
    value = environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if value not in CHOICES:
        from sftrecipes.core.errors import RecipeError

        raise RecipeError(f"{MODE_ENV}={value!r}: use one of {', '.join(CHOICES)} (auto: fp32 where this CPU has no "
                          "native bf16 GEMM)")
    if value == "auto":
        return "native" if native_bf16_gemm() else "fp32"
    return value


def _mode_class():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    products = {aten.mm.default, aten.bmm.default, aten.addmm.default, aten.baddbmm.default, aten.addbmm.default,
                aten.mv.default, aten.addmv.default, aten.dot.default}
    bf16 = torch.bfloat16

    class Bf16ProductsInFp32(TorchDispatchMode):
        """A matrix product whose tensor operands are all bf16 (on the CPU) runs on fp32 copies; its result is rounded
        to bf16. Any other op, and a product with an out= argument or mixed dtypes (which torch refuses), is torch's."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in products and "out" not in kwargs:
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                if tensors and all(t.dtype == bf16 and t.device.type == "cpu" for t in tensors):
                    up = [a.float() if isinstance(a, torch.Tensor) else a for a in args]
                    return func(*up, **kwargs).to(bf16)
            return func(*args, **kwargs)

    return Bf16ProductsInFp32


def apply(environ=os.environ) -> str:
    """On the cpu target: push the fp32-products mode for the rest of this process where choice() says fp32 (once);
    returns the choice. The fork server imports what the mode's first push imports (torch._dynamo, ~3 s)."""
    how = choice(environ)
    if how == "fp32" and not _active:
        from torch.utils._python_dispatch import _push_mode

        mode = _mode_class()()
        _push_mode(mode)
        _active.append(mode)
    return how


def active() -> bool:
    return bool(_active)


def describe(how: str) -> str:
    import torch

    cap = torch.backends.cpu.get_cpu_capability()
    if how == "fp32":
        return (f"cpu bf16 matmul: fp32 copies of bf16 operands, rounded to bf16 ({cap}: no native bf16 GEMM in torch's "
                f"CPU kernels; {MODE_ENV}=native keeps torch's)")
    return f"cpu bf16 matmul: torch's own ({cap})"
