"""Terminal entry point: `python -m flashspec_core "prompt"` streams coloured text, then prints the stats."""
from __future__ import annotations

import argparse
import sys

from flashspec_core.engine import PRESETS, Engine
from flashspec_core.models import PRECISIONS
from flashspec_core.sampling import SamplingConfig

COLOURS = {"accepted": "\033[32m", "resampled": "\033[33m", "bonus": "\033[36m", "rejected": "\033[9;31m", "plain": ""}
RESET = "\033[0m"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashspec_core", description=__doc__)
    ap.add_argument("prompt")
    ap.add_argument("--preset", default="embedded", choices=sorted(PRESETS))
    ap.add_argument("--target", help="a Hub id or folder instead of the preset's target")
    ap.add_argument("--drafters", nargs="+", help="drafters for --target (Hub ids/folders or prompt_lookup, ngram_cache)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--gamma", default="auto", help="K in 0..32, or auto")
    ap.add_argument("--mode", default="speculative", choices=["speculative", "plain"])
    ap.add_argument("--bandit", default="ucb1", choices=["ucb1", "thompson", "window"])
    ap.add_argument("--backend", default="auto", choices=["torch", "triton", "auto"])
    ap.add_argument("--precision", default="auto", choices=list(PRECISIONS),
                    help="the target's weights: gguf = the embedded model's own 4-bit file (CPU), float32 = "
                         "dequantised; auto = gguf where it can run")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-color", action="store_true", help="plain text, no ANSI colours")
    args = ap.parse_args(argv)
    try:
        gamma = args.gamma if args.gamma == "auto" else int(args.gamma)
        sampling = SamplingConfig(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
        if args.target:
            engine = Engine.from_pretrained(args.target, args.drafters or ["prompt_lookup", "ngram_cache"],
                                            kernel_backend=args.backend, bandit=args.bandit, precision=args.precision,
                                            progress=_progress)
        else:
            engine = Engine.from_preset(args.preset, kernel_backend=args.backend, bandit=args.bandit,
                                        precision=args.precision, progress=_progress)
        _progress(f"target precision: {engine.precision} ({engine.target.path})")
        events = []
        for event in engine.stream(args.prompt, args.max_new_tokens, sampling, gamma=gamma, mode=args.mode, seed=args.seed):
            events.append(event)
            for span in event.spans:
                if span.id in engine.eos_ids and span.kind != "rejected":
                    continue  # the end-of-turn token ends the text; it is not printed as "<|im_end|>"
                if args.no_color:
                    text = "" if span.kind == "rejected" else span.text
                else:
                    text = COLOURS[span.kind] + span.text + RESET
                sys.stdout.write(text)
            sys.stdout.flush()
    except ValueError as e:  # bad input and unavailable models are ValueErrors with a clear message
        print(f"error: {e}", file=sys.stderr)
        return 2
    from flashspec_core.engine import summarize

    stats = summarize(events)
    print("\n")
    if not args.no_color:
        print("legend: " + " ".join(f"{c}{k}{RESET}" for k, c in COLOURS.items() if k != "plain"))
    print(f"{stats['new_tokens']} tokens in {stats['elapsed_s']:.2f} s = {stats['tok_per_s']:.1f} tok/s | "
          f"acceptance {stats['acceptance']:.2f} | {stats['tokens_per_forward']:.2f} tokens per target forward | "
          f"{stats['target_forwards']} target forwards | arms {stats['pulls']}")
    return 0


def _progress(message: str) -> None:
    print(f"[flashspec] {message}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
