"""Command-line options of app.py: where the server listens (127.0.0.1 by default; 0.0.0.0 on Hugging Face
Spaces, where SPACE_ID is set, with --share, or wherever --host says), and what remote users may load.

Safe as a public server by default: model ids are Hub ids (or 'embedded'); local folders load only under the
folders the person starting the server names (--allow-local-models or FLASHSPEC_LOCAL_MODELS), pickled
checkpoints only with --allow-pickle (or FLASHSPEC_ALLOW_PICKLE=1). On a Space, set the variables in the
Space's settings.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from flashspec_core.models import PRECISIONS, LoadPolicy

from components.engine_cache import CacheConfig

LOCAL, ALL = "127.0.0.1", "0.0.0.0"
ENV_FOLDERS, ENV_PICKLE = "FLASHSPEC_LOCAL_MODELS", "FLASHSPEC_ALLOW_PICKLE"
ENV_MAX_ENGINES, ENV_MAX_GIB = "FLASHSPEC_MAX_ENGINES", "FLASHSPEC_MAX_ENGINE_GB"
ENV_PRECISION = "FLASHSPEC_PRECISION"
TRUE = ("1", "true", "yes", "on")


def parse_args(argv=None, environ=os.environ) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="FlashSpec demo: exact speculative decoding, live.")
    parser.add_argument("--host", default=None, help=f"address to listen on (default {LOCAL}; {ALL} on Spaces)")
    parser.add_argument("--port", type=int, default=int(environ.get("GRADIO_SERVER_PORT", 7860)),
                        help="port (default 7860, or GRADIO_SERVER_PORT)")
    parser.add_argument("--share", action="store_true", help=f"make a public gradio link (listens on {ALL})")
    parser.add_argument("--no-preload", action="store_true", help="do not load the embedded model at start-up")
    parser.add_argument("--allow-local-models", nargs="+", metavar="FOLDER", default=None,
                        help=f"let users load model folders under these folders, by absolute path (default: none; "
                             f"or {ENV_FOLDERS}=dir1{os.pathsep}dir2)")
    parser.add_argument("--allow-pickle", action="store_true",
                        help=f"let such folders load pickled (.bin) weights when they have no safetensors "
                             f"(default: safetensors only; or {ENV_PICKLE}=1)")
    parser.add_argument("--max-engines", type=int, default=int(environ.get(ENV_MAX_ENGINES, 3)),
                        help=f"loaded model pairs kept, the embedded default included (default 3, or {ENV_MAX_ENGINES})")
    parser.add_argument("--max-engine-gb", type=float, default=float(environ.get(ENV_MAX_GIB, 8)),
                        help=f"GiB of weights kept loaded; least recently used pairs go first (default 8, or {ENV_MAX_GIB})")
    parser.add_argument("--precision", default=environ.get(ENV_PRECISION, "auto"), choices=list(PRECISIONS),
                        help=f"the target's weights: gguf = the embedded model's own 4-bit file (CPU), float32 = "
                             f"dequantised; auto = gguf where it can run (default, or {ENV_PRECISION})")
    args = parser.parse_args(argv)
    try:
        args.cache = cache_config(args, environ)
    except ValueError as e:
        parser.error(str(e))
    return args


def cache_config(args: argparse.Namespace, environ=os.environ) -> CacheConfig:
    """The engine cache's policy and limits from the options, else the environment; raises ValueError."""
    folders = args.allow_local_models
    if folders is None:
        folders = [f for f in environ.get(ENV_FOLDERS, "").split(os.pathsep) if f.strip()]
    for folder in folders:
        if not Path(folder).is_absolute() or not Path(folder).is_dir():
            raise ValueError(f"--allow-local-models: {folder!r} is not an absolute path to a folder")
    pickle = args.allow_pickle or environ.get(ENV_PICKLE, "").strip().lower() in TRUE
    policy = LoadPolicy(local_roots=tuple(folders), allow_pickle=pickle)
    return CacheConfig(policy=policy, max_engines=args.max_engines, max_gib=args.max_engine_gb,
                       precision=getattr(args, "precision", "auto"))


def server_name(host: str | None, share: bool, environ=os.environ) -> str:
    if host:
        return host
    return ALL if share or environ.get("SPACE_ID") else LOCAL
