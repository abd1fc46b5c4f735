"""One browser session's state (its gr.State): its runs, the names of the runs it loaded from files (kept in
components.compact.LOADED), the replay position, a stop request, and its exported files (components.exports).

Plain data only (no locks, no engines): on ZeroGPU the run handlers receive a pickled copy of it in a forked
worker and hand the changed copy back as an output.
"""
from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from components.compact import LOADED, CompactRun, compact
from components.exports import FOLDERS
from components.runs import Run, export_runs

MAX_REPLAYABLE = 24  # runs whose round events a session keeps (older runs keep only their table row)


class ExportRefused(RuntimeError):
    """An export over the session's or the server's limit (components.exports); its message says which."""


@dataclass
class Session:
    id: str = field(default_factory=lambda: uuid.uuid4().hex)  # names the session's folder of exports
    runs: list[Run] = field(default_factory=list)  # finished runs and race legs, oldest first
    loaded: list[tuple[str, str]] = field(default_factory=list)  # (name, label) of runs loaded from files, oldest first
    finished: int = 0  # runs and races finished, for their ids
    exported: int = 0  # exports written, for their file names
    last_events: list = field(default_factory=list)  # the last Run's round events, to re-render its text
    stop_requested: bool = False  # set by the Stop button, read by the running handler between updates
    replay_name: str = ""  # the run being replayed (its name)
    replay_shown: int = 0  # rounds of it on screen
    replay_paused: bool = False  # set by Pause, read by the playing handler
    replay_epoch: int = 0  # bumped by every Play, step, restart or pick: an older Play sees it and sends no more

    def next_id(self, kind: str) -> str:
        self.finished += 1
        return f"{kind} {self.finished}"

    def add(self, run: Run) -> None:
        """Record a finished run; runs beyond the last MAX_REPLAYABLE drop their round events."""
        self.runs.append(run)
        for i, old in enumerate(self.runs[:-MAX_REPLAYABLE]):
            if old.events:
                self.runs[i] = dataclasses.replace(old, events=())

    def load(self, runs: list[CompactRun]) -> None:
        """Keep runs loaded from a file (server-wide store, bounded); raises compact.RunsTooLarge."""
        LOADED.add(self.id, runs)
        names = {r.name for r in runs}
        self.loaded = [x for x in self.loaded if x[0] not in names] + [(r.name, r.label()) for r in runs]

    def choices(self) -> list[tuple[str, str]]:
        """(label, name) of the runs that can be replayed, newest first: this session's, then the loaded ones still
        kept (the store may have dropped the least recently used)."""
        kept = LOADED.names(self.id)
        self.loaded = [x for x in self.loaded if x[0] in kept]
        return [(r.label(), r.name) for r in reversed(self.runs) if r.events] + \
            [(label, name) for name, label in reversed(self.loaded)]

    def find(self, name: str) -> CompactRun | None:
        """The run of that name, ready to replay."""
        run = next((r for r in reversed(self.runs) if r.events and r.name == name), None)
        if run is not None:
            return compact(run.record, run.prompt, run.events)
        return LOADED.get(self.id, name)

    def exports(self) -> tuple[Path, Path]:
        """Write the runs to this session's folder (replacing the previous export); return the two paths. Raises
        ExportRefused when the files are over the session's or the server's limit (they are then removed)."""
        folder = FOLDERS.folder(self.id)
        self.exported += 1
        paths = export_runs(self.runs, folder, tag=f"_{self.exported}")
        why = FOLDERS.admit(self.id)
        if why:
            raise ExportRefused(why)
        return paths

    def clear(self) -> None:
        """Forget every run (own and loaded) and delete the session's files."""
        self.runs.clear()
        self.last_events = []
        self.loaded = []
        self.replay_name, self.replay_shown = "", 0
        LOADED.drop(self.id)
        FOLDERS.remove(self.id)


def new_session() -> Session:
    """gr.State's value: called once per browser session, so each gets its own id."""
    return Session()


def forget(state: Session) -> None:
    """gr.State's delete_callback: remove the session's files and loaded runs when gradio deletes its state."""
    if isinstance(state, Session):
        FOLDERS.remove(state.id)
        LOADED.drop(state.id)
