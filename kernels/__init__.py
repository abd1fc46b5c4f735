"""Verification kernels: a pure-PyTorch reference and a Triton kernel behind one backend switch."""
from kernels.verify import (BACKENDS, VerifyResult, draw_randoms, resolve_backend, triton_available, verify, verify_torch,
                            verify_triton)

__all__ = ["BACKENDS", "VerifyResult", "draw_randoms", "resolve_backend", "triton_available", "verify", "verify_torch",
           "verify_triton"]
