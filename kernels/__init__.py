"""Verification kernels: a pure-PyTorch reference and a Triton kernel behind one backend switch, per op (a chain
of drafts: kernels/verify.py; a tree of drafts: kernels/tree_verify.py)."""
from kernels.tree_verify import TreeShape, TreeVerifyResult, verify_tree, verify_tree_torch, verify_tree_triton
from kernels.verify import (BACKENDS, VerifyResult, draw_randoms, resolve_backend, triton_available, verify, verify_torch,
                            verify_triton)

__all__ = ["BACKENDS", "TreeShape", "TreeVerifyResult", "VerifyResult", "draw_randoms", "resolve_backend",
           "triton_available", "verify", "verify_torch", "verify_tree", "verify_tree_torch", "verify_tree_triton",
           "verify_triton"]
