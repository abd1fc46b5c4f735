"""FlashSpec demo: builds the Blocks from the panels in components/, wires their events, and launches.

    python app.py [--host HOST] [--port PORT] [--share] [--no-preload]
                  [--allow-local-models FOLDER ...] [--allow-pickle] [--max-engines N] [--max-engine-gb GB]

Runs (Run and Race) share one gradio concurrency group with concurrency_limit=1, so they queue one after the
other; each also holds its engine's lock for its whole length (components.engine_cache). Loading a run file
takes its turn in that group too; replays have a group of their own (a few at once, each bounded in time:
components.replay_handlers). Their inputs reach the handlers
raw (preprocess=False) and are checked there, so API callers get the same short messages as the page. The queue
holds at most MAX_QUEUE events, MAX_WAITING_PER_CLIENT of them from one client. Sessions keep their own runs in a
gr.State, whose files go when gradio deletes it.
"""
from __future__ import annotations

from components.wiring import on_zero_gpu, wire  # first: imports `spaces` (Hugging Face ZeroGPU) if present

import threading

import gradio as gr

from components import engine_cache, handlers, replay_handlers
from components.arms import build_arms
from components.exports import FOLDERS
from components.launch import parse_args, server_name
from components.queue_limits import limit_per_client
from components.prompt import ASSETS, build_prompt
from components.race import build_race
from components.replay import build_replay
from components.runs import build_runs
from components.session import forget, new_session
from components.settings import DEFAULT_PAIR, RACE_SETTING_NAMES, SETTING_NAMES, build_settings, resolve_pair
from components.tokens import build_tokens

RUN_INPUTS = ["state", "prompt", "example", "keep_rejected", *SETTING_NAMES]
RACE_INPUTS = ["state", "prompt", "example", "keep_rejected", *RACE_SETTING_NAMES]
SHARED = ["status", "runs_table", "download_csv", "download_json", "state", "tabs", "replay_pick"]
STREAM_OUTPUTS = ["tokens", "stream_stats", "arms_plot", *SHARED]
RACE_OUTPUTS = ["a_title", "a_tokens", "a_stats", "b_title", "b_tokens", "b_stats", "race_summary", "race_plot",
                *SHARED]
REPLAY_OUTPUTS = ["replay_tokens", "replay_stats", "replay_position", "replay_arms", "state"]
RUNS = dict(concurrency_limit=1, concurrency_id="engine", preprocess=False)  # one run at a time, app-wide
REPLAYS = dict(concurrency_limit=4, concurrency_id="replay")  # no torch: a few sessions may replay at once
LOADS = dict(concurrency_limit=1, concurrency_id="engine")  # checking a run file (~2 s of Python for 10 MB) would
# slow a run on the same cores tenfold (they contend for the GIL): loads take turns with runs instead
SESSION_TTL_S = 3 * 3600  # a session's state (and files) go after this long without an update
GRADIO_CACHE = (60, 180)  # every minute, delete gradio's temporary files (uploads never loaded) older than 3 min
MAX_QUEUE, MAX_WAITING_PER_CLIENT = 64, 8  # events waiting in the queue: in all, from one client


def layout() -> dict:
    """The panels; returns every component by name."""
    ui: dict = {"state": gr.State(new_session, time_to_live=SESSION_TTL_S, delete_callback=forget)}
    gr.Markdown("# FlashSpec\nExact speculative decoding, live: drafters chosen online by a bandit; "
                "the output follows the target model's distribution exactly.", elem_id="title")
    with gr.Row():
        with gr.Column(scale=2, min_width=340):
            ui |= build_prompt(handlers.EXAMPLES)
            with gr.Accordion("Settings", open=True, elem_id="settings"):
                ui |= build_settings()
        with gr.Column(scale=3, min_width=480):
            with gr.Tabs(selected="stream") as ui["tabs"]:
                with gr.Tab("Stream", id="stream"):
                    ui |= build_tokens()
                    ui |= build_arms()
                with gr.Tab("Side by side", id="race"):
                    ui |= build_race()
                with gr.Tab("Replay", id="replay"):
                    ui |= build_replay()
                with gr.Tab("Runs", id="runs"):
                    ui |= build_runs()
    return ui


def wire_events(ui: dict, zero_gpu: bool = False) -> None:
    progress = dict(show_progress_on=[ui["status"]])  # the loading bar covers the status line, not the text
    run = wire(ui["run_btn"].click, handlers.run_stream, ui, RUN_INPUTS, STREAM_OUTPUTS, on_gpu=True,
               **RUNS, **progress)
    race = wire(ui["race_btn"].click, handlers.run_race, ui, RACE_INPUTS, RACE_OUTPUTS, on_gpu=True,
                **RUNS, **progress)
    # On ZeroGPU the run's state is a copy in a forked worker, which never sees the stop request: cancel too.
    wire(ui["stop_btn"].click, handlers.stop, ui, ["state"], ["status"], cancels=[run, race] if zero_gpu else None)
    wire(ui["keep_rejected"].change, handlers.show_rejected, ui, ["state", "keep_rejected"], ["tokens"])
    wire(ui["clear_runs"].click, handlers.clear_runs, ui, ["state"],
         ["runs_table", "download_csv", "download_json", "state", "status", "replay_pick"])
    wire(ui["example"].change, handlers.pick_example, ui, ["example"], ["prompt", "max_new_tokens"])
    for prefix, handler in (("", handlers.pick_pair), ("a_", handlers.pick_pair_a), ("b_", handlers.pick_pair_b)):
        wire(ui[prefix + "pair"].change, handler, ui, [prefix + "pair"],
             [prefix + name for name in ("custom_row", "roles", "shape")])
    wire_replay(ui)


def wire_replay(ui: dict) -> None:
    pick = ["state", "replay_pick"]
    play = wire(ui["replay_play"].click, replay_handlers.replay_play, ui, [*pick, "replay_speed"], REPLAY_OUTPUTS,
                preprocess=False, **REPLAYS)
    # picking, stepping and restarting stop a play in progress, so that its last frame cannot land after theirs
    wire(ui["replay_pick"].input, replay_handlers.replay_pick, ui, pick, REPLAY_OUTPUTS, preprocess=False, cancels=[play])
    wire(ui["replay_step"].click, replay_handlers.replay_step, ui, pick, REPLAY_OUTPUTS, preprocess=False, cancels=[play])
    wire(ui["replay_restart"].click, replay_handlers.replay_restart, ui, pick, REPLAY_OUTPUTS, preprocess=False,
         cancels=[play])
    wire(ui["replay_pause"].click, replay_handlers.replay_pause, ui, ["state"], [])
    wire(ui["replay_upload"].upload, replay_handlers.replay_load, ui, ["state", "replay_upload"],
         [*REPLAY_OUTPUTS, "replay_pick"], **LOADS)


def build_app(zero_gpu: bool = False) -> gr.Blocks:
    with gr.Blocks(title="FlashSpec: exact speculative decoding", analytics_enabled=False,
                   delete_cache=GRADIO_CACHE) as demo:
        wire_events(layout(), zero_gpu)
    return demo


def main(argv=None) -> None:
    args = parse_args(argv)
    engine_cache.ENGINES.configure(args.cache)
    if not args.no_preload:  # the embedded model loads while the page opens; a first run waits for it
        # On ZeroGPU the main process has no GPU: load there (spaces moves the weights), warm up in the first run.
        threading.Thread(target=engine_cache.preload, args=(resolve_pair(DEFAULT_PAIR),),
                         kwargs=dict(warm=not on_zero_gpu()), daemon=True).start()
    gr.set_static_paths([FOLDERS.root])  # exports are served from the sessions' folders, not copied
    demo = build_app(on_zero_gpu()).queue(default_concurrency_limit=1, max_size=MAX_QUEUE)
    limit_per_client(demo, MAX_WAITING_PER_CLIENT)
    demo.launch(
        server_name=server_name(args.host, args.share), server_port=args.port, share=args.share,
        css_paths=[ASSETS / "app.css"], footer_links=["api", "gradio", "settings"], max_file_size="10mb")


if __name__ == "__main__":
    main()
