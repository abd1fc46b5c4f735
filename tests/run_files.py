"""Run files (the JSON export's format) written for the tests and the replay benchmark: valid ones of any size,
and the hostile values a remote user may put in them."""
from __future__ import annotations

import json
from pathlib import Path

from components.runs import COLUMNS, FORMAT, VERSION


def round_dict(j: int, spans: int, gap: float, tokens_before: int, last: bool) -> dict:
    """Round j: spans - 1 accepted drafts and a bonus token, ending at (j + 1) * gap seconds."""
    accepted = [100 + (j + i) % 500 for i in range(spans - 1)]
    pieces = [["accepted", t, f"w{t} ", 0.9, 1.0] for t in accepted] + [["bonus", 7, "x\n", 0.5, None]]
    return {"index": j, "mode": "speculative", "drafter": "prompt_lookup", "gamma": spans - 1, "accepted": accepted,
            "rejected": [], "resampled": None, "bonus": 7, "spans": pieces, "text": "".join(p[2] for p in pieces),
            "draft_s": 0.0001, "verify_s": 0.01, "round_s": 0.0101, "elapsed_s": round((j + 1) * gap, 6),
            "new_tokens": tokens_before + spans, "arms": [], "finished": "length" if last else None, "prefill_s": 0.01}


def run_document(rounds: int = 20, spans: int = 5, gap: float = 0.05, name: str = "run 1", **record) -> dict:
    events = [round_dict(j, spans, gap, j * spans, j == rounds - 1) for j in range(rounds)]
    row = {**dict.fromkeys(COLUMNS), "run": name, "mode": "speculative", "bandit": "ucb1", "new_tokens": rounds * spans,
           **record}
    return {"format": FORMAT, "version": VERSION, "runs": [{**row, "prompt": "hi", "events": events}]}


def write(path: Path, doc: dict) -> Path:
    path.write_text(json.dumps(doc))
    return path
