"""The CPU kernels of `csrc/` (the GGUF products at the file's own precision), compiled once per machine with the
system's C++ compiler and loaded as torch ops (`torch.ops.flashspec.*`); `load()` says whether they are there.

The library is built with `-march=native` (so the AVX512-VNNI kernel where the CPU has it) into
`cache_dir()/native/<hash of the sources, torch, Python and CPU>/`, which later starts load in milliseconds. Without
a compiler, or if the build fails, `load()` returns False with the reason in `why_not()` and callers keep torch's
own kernels.
"""
from __future__ import annotations

import hashlib
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

SOURCES = [Path(__file__).resolve().parent / "csrc" / "q4_1.cpp"]
FLAGS = ["-O3", "-march=native", "-std=c++17", "-ffp-contract=off"]  # no fused multiply-adds but the written ones
_state: dict = {}  # "ok": bool, "why": str; set by the first load()


def _cpu_signature() -> str:
    """The CPU's model name and flags (the build uses -march=native, so another CPU gets its own build)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return "\n".join(sorted({l for l in lines if l.startswith(("model name", "flags"))}))
    except OSError:
        return platform.processor() or platform.machine()


def _build_dir() -> Path:
    from flashspec_core.models import cache_dir

    h = hashlib.sha256()
    for src in SOURCES:
        h.update(src.read_bytes())
    h.update(f"{torch.__version__} {sys.version} {_cpu_signature()} {FLAGS}".encode())
    return cache_dir() / "native" / h.hexdigest()[:16]


def _compile(out: Path) -> None:
    from torch.utils.cpp_extension import include_paths, library_paths

    cxx = os.environ.get("CXX", "c++")
    cmd = [cxx, *FLAGS, "-shared", "-fPIC", "-fopenmp",
           f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
           *[f"-I{p}" for p in include_paths()], *map(str, SOURCES),
           *[f"-L{p}" for p in library_paths()], "-lc10", "-ltorch_cpu", "-o", str(out)]
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    cmd[-1] = str(tmp)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        errors = [l for l in done.stderr.splitlines() if "error" in l] or done.stderr.strip().splitlines()[-5:]
        raise RuntimeError(f"{cxx} failed: " + "\n".join(errors)[-1500:])
    tmp.replace(out)  # atomic: a concurrent start sees the whole library or none


def load() -> bool:
    """Build (first time on this machine) and load the kernels; True when `torch.ops.flashspec` has them."""
    if "ok" not in _state:
        try:
            if platform.system() != "Linux":
                raise RuntimeError(f"the native kernels are built on Linux only, not {platform.system()}")
            lib = _build_dir() / "flashspec_native.so"
            if not lib.exists():
                lib.parent.mkdir(parents=True, exist_ok=True)
                _compile(lib)
            torch.ops.load_library(str(lib))
            _state.update(ok=True, why="")
        except (OSError, RuntimeError) as e:
            _state.update(ok=False, why=str(e))
    return _state["ok"]


def why_not() -> str:
    """Why `load()` returned False ("" when it did not, or before it ran)."""
    return _state.get("why", "")
