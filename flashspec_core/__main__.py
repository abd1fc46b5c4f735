"""Terminal entry point: `python -m flashspec_core "prompt"` streams coloured text, then prints the stats."""
from __future__ import annotations

import argparse
import sys

from flashspec_core.engine import PRESETS, Engine
from flashspec_core.models import PRECISIONS
from flashspec_core.sampling import SamplingConfig

COLOURS = {"accepted": "\033[32m", "resampled": "\033[33m", "bonus": "\033[36m", "rejected": "\033[9;31m", "plain": ""}
RESET = "\033[0m"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flashspec_core", description=__doc__)
    ap.add_argument("prompt")
    ap.add_argument("--preset", default="embedded", choices=sorted(PRESETS))
    ap.add_argument("--target", help="a Hub id or folder instead of the preset's target")
    ap.add_argument("--drafters", nargs="+", help="drafters for --target (Hub ids/folders or prompt_lookup, ngram_cache)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--gamma", default="auto", type=_gamma, help="K in 0..32, or auto")
    ap.add_argument("--mode", default="speculative", choices=["speculative", "plain"])
    ap.add_argument("--bandit", default="ucb1", choices=["ucb1", "thompson", "window"])
    ap.add_argument("--backend", default="auto", choices=["torch", "triton", "auto"])
    ap.add_argument("--precision", default="auto", choices=list(PRECISIONS),
                    help="the target's weights: gguf = the embedded model's own 4-bit file (CPU), float32 = "
                         "dequantised; auto = gguf where it can run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-color", action="store_true", help="plain text, no ANSI colours")
    return ap


def _gamma(value: str):
    if value == "auto":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"K must be an integer or auto, got {value!r}") from None


def build_engine(args) -> Engine:
    """The preset's engine, or --target with --drafters."""
    if args.target:
        return Engine.from_pretrained(args.target, args.drafters or ["prompt_lookup", "ngram_cache"],
                                      kernel_backend=args.backend, bandit=args.bandit, precision=args.precision,
                                      progress=_progress)
    return Engine.from_preset(args.preset, kernel_backend=args.backend, bandit=args.bandit, precision=args.precision,
                              progress=_progress)


def write_spans(event, eos_ids, color: bool) -> None:
    """A round's text as it streams: coloured by span kind, or plain text without the rejected drafts."""
    for span in event.spans:
        if span.id in eos_ids and span.kind != "rejected":
            continue  # the end-of-turn token ends the text; it is not printed as "<|im_end|>"
        if color:
            sys.stdout.write(COLOURS[span.kind] + span.text + RESET)
        elif span.kind != "rejected":
            sys.stdout.write(span.text)
    sys.stdout.flush()


def print_stats(events, color: bool) -> None:
    from flashspec_core.engine import summarize

    stats = summarize(events)
    print("\n")
    if color:
        print("legend: " + " ".join(f"{c}{k}{RESET}" for k, c in COLOURS.items() if k != "plain"))
    print(f"{stats['new_tokens']} tokens in {stats['elapsed_s']:.2f} s = {stats['tok_per_s']:.1f} tok/s | "
          f"acceptance {stats['acceptance']:.2f} | {stats['tokens_per_forward']:.2f} tokens per target forward | "
          f"{stats['target_forwards']} target forwards | arms {stats['pulls']}")


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    events = []
    try:
        sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        engine = build_engine(args)
        _progress(f"target precision: {engine.precision} ({engine.target.path})")
        for event in engine.stream(args.prompt, args.max_new_tokens, sampling, gamma=args.gamma, mode=args.mode,
                                   seed=args.seed):
            events.append(event)
            write_spans(event, engine.eos_ids, not args.no_color)
    except ValueError as e:  # bad input and unavailable models are ValueErrors with a clear message
        print(f"error: {e}", file=sys.stderr)
        return 2
    print_stats(events, not args.no_color)
    return 0


def _progress(message: str) -> None:
    print(f"[flashspec] {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
