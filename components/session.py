"""One browser session's state (its gr.State): its runs, the runs loaded from files, the replay position, a
stop request, and its exported files (components.exports).

Plain data only (no locks, no engines): on ZeroGPU the run handlers receive a pickled copy of it in a forked
worker and hand the changed copy back as an output.
"""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from components.exports import FOLDERS
from components.runs import Run, export_runs

MAX_REPLAYABLE = 24  # runs whose round events a session keeps (older runs keep only their table row)
MAX_LOADED_ROUNDS = 30_000  # rounds of the runs loaded from files, all together (the oldest go first)


@dataclass
class Session:
    id: str = field(default_factory=lambda: uuid.uuid4().hex)  # names the session's folder of exports
    runs: list[Run] = field(default_factory=list)  # finished runs and race legs, oldest first
    loaded: list[Run] = field(default_factory=list)  # runs loaded from exported files, for replay
    finished: int = 0  # runs and races finished, for their ids
    exported: int = 0  # exports written, for their file names
    last_events: list = field(default_factory=list)  # the last Run's round events, to re-render its text
    stop_requested: bool = False  # set by the Stop button, read by the running handler between updates
    replay_name: str = ""  # the run being replayed (Run.name)
    replay_shown: int = 0  # rounds of it on screen
    replay_paused: bool = False  # set by Pause, read by the playing handler

    def next_id(self, kind: str) -> str:
        self.finished += 1
        return f"{kind} {self.finished}"

    def add(self, run: Run) -> None:
        """Record a finished run; runs beyond the last MAX_REPLAYABLE drop their round events."""
        self.runs.append(run)
        for i, old in enumerate(self.runs[:-MAX_REPLAYABLE]):
            if old.events:
                self.runs[i] = dataclasses.replace(old, events=())

    def load(self, runs: list[Run]) -> None:
        self.loaded = self.loaded + runs
        while sum(len(r.events) for r in self.loaded) > MAX_LOADED_ROUNDS:
            self.loaded.pop(0)

    def replayable(self) -> list[Run]:
        """Runs that can be replayed, newest first: this session's, then the loaded ones."""
        return [r for r in reversed(self.runs) if r.events] + list(reversed(self.loaded))

    def find(self, name: str) -> Run | None:
        return next((r for r in self.replayable() if r.name == name), None)

    def exports(self) -> tuple[Path, Path]:
        """Write the runs to this session's folder (replacing the previous export); return the two paths."""
        folder = FOLDERS.folder(self.id)
        self.exported += 1
        for old in folder.glob("flashspec_runs_*"):
            old.unlink(missing_ok=True)
        return export_runs(self.runs, folder, tag=f"_{self.exported}")


def new_session() -> Session:
    """gr.State's value: called once per browser session, so each gets its own id."""
    return Session()


def forget(state: Session) -> None:
    """gr.State's delete_callback: remove the session's files when gradio deletes its state."""
    if isinstance(state, Session):
        FOLDERS.remove(state.id)
