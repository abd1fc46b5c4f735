"""FlashSpec demo: builds the Blocks from the panels in components/, wires their events, and launches.

    python app.py [--host HOST] [--port PORT] [--share] [--no-preload]

Runs (Run and Race) share one gradio concurrency group with concurrency_limit=1, so they queue one after the
other; each also holds its engine's lock for its whole length (components.engine_cache). Sessions keep their
own runs table in a gr.State.
"""
from __future__ import annotations

from components.wiring import wire  # first: imports `spaces` (Hugging Face ZeroGPU) if present

import threading

import gradio as gr

from components import engine_cache, handlers
from components.arms import build_arms
from components.launch import parse_args, server_name
from components.prompt import ASSETS, build_prompt
from components.race import build_race
from components.runs import build_runs
from components.settings import DEFAULT_PAIR, SETTING_NAMES, build_settings, resolve_pair
from components.tokens import build_tokens

RUN_INPUTS = ["state", "prompt", "example", "keep_rejected", *SETTING_NAMES]
SHARED = ["status", "runs_table", "download_csv", "download_json", "state", "tabs"]
STREAM_OUTPUTS = ["tokens", "stream_stats", "arms_plot", *SHARED]
RACE_OUTPUTS = ["plain_tokens", "plain_stats", "spec_tokens", "spec_stats", "race_summary", "race_plot", *SHARED]
RUNS = dict(concurrency_limit=1, concurrency_id="engine")  # one run at a time, app-wide


def build_app() -> gr.Blocks:
    with gr.Blocks(title="FlashSpec: exact speculative decoding", analytics_enabled=False) as demo:
        ui: dict = {"state": gr.State(handlers.Session())}
        gr.Markdown("# FlashSpec\nExact speculative decoding, live: drafters chosen online by a bandit; "
                    "the output follows the target model's distribution exactly.", elem_id="title")
        with gr.Row():
            with gr.Column(scale=2, min_width=340):
                ui |= build_prompt(handlers.EXAMPLES)
                with gr.Accordion("Settings", open=True):
                    ui |= build_settings()
            with gr.Column(scale=3, min_width=480):
                with gr.Tabs(selected="stream") as ui["tabs"]:
                    with gr.Tab("Stream", id="stream"):
                        ui |= build_tokens()
                        ui |= build_arms()
                    with gr.Tab("Side by side", id="race"):
                        ui |= build_race()
                    with gr.Tab("Runs", id="runs"):
                        ui |= build_runs()

        progress = dict(show_progress_on=[ui["status"]])  # the loading bar covers the status line, not the text
        wire(ui["run_btn"].click, handlers.run_stream, ui, RUN_INPUTS, STREAM_OUTPUTS, on_gpu=True,
             **RUNS, **progress)
        wire(ui["race_btn"].click, handlers.run_race, ui, RUN_INPUTS, RACE_OUTPUTS, on_gpu=True,
             **RUNS, **progress)
        wire(ui["stop_btn"].click, handlers.stop, ui, ["state"], ["status"])
        wire(ui["keep_rejected"].change, handlers.show_rejected, ui, ["state", "keep_rejected"], ["tokens"])
        wire(ui["clear_runs"].click, handlers.clear_runs, ui, ["state"],
             ["runs_table", "download_csv", "download_json", "state", "status"])
        wire(ui["example"].change, handlers.pick_example, ui, ["example"], ["prompt", "max_new_tokens"])
        wire(ui["pair"].change, handlers.pick_pair, ui, ["pair"], ["custom_row", "roles"])
    return demo


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.no_preload:  # the embedded model loads while the page opens; a first run waits for it
        threading.Thread(target=engine_cache.preload, args=(resolve_pair(DEFAULT_PAIR),), daemon=True).start()
    build_app().queue(default_concurrency_limit=1).launch(
        server_name=server_name(args.host, args.share), server_port=args.port, share=args.share,
        css_paths=[ASSETS / "app.css"], footer_links=["api", "gradio", "settings"])


if __name__ == "__main__":
    main()
