"""Kernel tests run on CUDA when there is a GPU; otherwise the Triton kernel runs in Triton's CPU interpreter.

Triton chooses between compiler and interpreter when it is imported and when `@triton.jit` runs, so on a machine
without CUDA TRITON_INTERPRET=1 must be set before anything imports triton or `kernels.verify`. Running
`pytest tests/kernels` alone, this file does it. In a full run the engine's tests import `kernels.verify` first;
set TRITON_INTERPRET=1 in the environment (or at the top of tests/conftest.py) for that case.
"""
import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda")
    verify_module = importlib.import_module("kernels.verify")
    kernel = getattr(verify_module, "_verify_kernel", None)
    if kernel is not None and type(kernel).__name__ != "InterpretedFunction":
        pytest.fail("no CUDA, and triton was imported before TRITON_INTERPRET=1 was set (the engine's tests import "
                    "kernels.verify first in a full run): set TRITON_INTERPRET=1 in the environment or at the top of "
                    "tests/conftest.py")
    return torch.device("cpu")
