"""Small checks for values that arrive from outside (an API caller, a web form): what an error message may
show of them, and whether a number is a real integer. Error messages quote values through `shown`, so a
100,000-character string comes back as a short prefix, never whole.
"""
from __future__ import annotations

import numbers

SHOWN_CHARS = 48  # how much of a typed value an error message repeats
SEED_RANGE = (-(1 << 63), (1 << 64) - 1)  # the seeds torch.Generator.manual_seed accepts: 64-bit integers


def shown(value, limit: int = SHOWN_CHARS) -> str:
    """repr(value), cut to `limit` characters with an ellipsis (and the total length) when longer."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({len(text):,} characters)"


def is_int(value) -> bool:
    """True for ints (Python or numpy), False for bools, floats, strings and everything else."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """True for ints and floats (Python or numpy), False for bools and everything else; NaN and inf included."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def check_text(text: str, what: str = "the prompt") -> None:
    """Refuse text that cannot be encoded as UTF-8 (a lone surrogate such as '\\ud800' from a JSON request)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        bad = text[e.start]
        raise ValueError(f"{what} contains a lone surrogate (U+{ord(bad):04X}) at character {e.start}; "
                         "send valid Unicode text") from None
