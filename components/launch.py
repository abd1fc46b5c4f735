"""Command-line options of app.py and where the server listens: 127.0.0.1 by default; 0.0.0.0 on Hugging
Face Spaces (SPACE_ID set), with --share, or wherever --host says."""
from __future__ import annotations

import argparse
import os

LOCAL, ALL = "127.0.0.1", "0.0.0.0"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="FlashSpec demo: exact speculative decoding, live.")
    parser.add_argument("--host", default=None, help=f"address to listen on (default {LOCAL}; {ALL} on Spaces)")
    parser.add_argument("--port", type=int, default=int(os.environ.get("GRADIO_SERVER_PORT", 7860)),
                        help="port (default 7860, or GRADIO_SERVER_PORT)")
    parser.add_argument("--share", action="store_true", help=f"make a public gradio link (listens on {ALL})")
    parser.add_argument("--no-preload", action="store_true", help="do not load the embedded model at start-up")
    return parser.parse_args(argv)


def server_name(host: str | None, share: bool, environ=os.environ) -> str:
    if host:
        return host
    return ALL if share or environ.get("SPACE_ID") else LOCAL
