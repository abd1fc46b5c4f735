"""The prompt panel: example prompts (data in assets/examples.json), the prompt box, the run buttons and the
status line (elem_id "status") where every error ends up.
"""
from __future__ import annotations

import json
from pathlib import Path

import gradio as gr

from components.settings import MAX_PROMPT_CHARS

ASSETS = Path(__file__).resolve().parent.parent / "assets"
EXAMPLES_PATH = ASSETS / "examples.json"
READY = ("Ready. Pick an example or type a prompt, then **Run**, or **Race** configuration A against B "
         "(by default plain against speculative decoding, set under *Side by side*).")


def load_examples(path: Path = EXAMPLES_PATH) -> list[dict]:
    """The example prompts: a list of {name, kind, prompt, max_new_tokens}. Raises ValueError on a malformed file."""
    examples = json.loads(Path(path).read_text())
    for i, ex in enumerate(examples):
        missing = {"name", "kind", "prompt", "max_new_tokens"} - set(ex)
        if missing:
            raise ValueError(f"{path}: example {i} lacks {sorted(missing)}")
    names = [ex["name"] for ex in examples]
    if len(set(names)) != len(names):
        raise ValueError(f"{path}: example names must be unique, got {names}")
    return examples


def example_by_name(examples: list[dict], name: str | None) -> dict | None:
    return next((ex for ex in examples if ex["name"] == name), None)


def build_prompt(examples: list[dict]) -> dict[str, gr.components.Component]:
    first = examples[0] if examples else None
    c = {}
    c["example"] = gr.Dropdown([ex["name"] for ex in examples], value=first["name"] if first else None,
                               label="Example prompt", elem_id="example")
    c["prompt"] = gr.Textbox(first["prompt"] if first else "", lines=8, max_lines=20, label="Prompt",
                             elem_id="prompt", max_length=MAX_PROMPT_CHARS)
    with gr.Row(equal_height=True):
        c["run_btn"] = gr.Button("Run", variant="primary", elem_id="run-btn", size="md", scale=2)
        c["race_btn"] = gr.Button("Race A vs B", elem_id="race-btn", size="md", scale=3)
        c["stop_btn"] = gr.Button("Stop", variant="stop", elem_id="stop-btn", size="md", scale=1, min_width=70)
    c["status"] = gr.Markdown(READY, elem_id="status")
    return c
