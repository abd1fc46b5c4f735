"""A session's temporary files (its exported runs): one folder per session inside one app-wide folder, removed
when the session's state is deleted (gradio does that after the tab closes, or after the state's time to
live) and, least recently written first, whenever more than `keep` sessions have folders.

The app-wide folder is registered with gradio as static (`gr.set_static_paths`), so the download buttons
serve these files where they are: no copy of each export piles up in gradio's own cache. Folder names are
random (uuid4), so one session cannot guess another's.
"""
from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path


class SessionFolders:
    """Session folders under one root; the file system is the registry, so a forked worker (ZeroGPU) and the
    main process agree on it."""

    def __init__(self, keep: int = 8, root: Path | None = None):
        self.keep = keep
        self._root = root
        self._lock = threading.RLock()  # folder() holds it while root and folders() take it again

    @property
    def root(self) -> Path:
        """The app-wide folder, made on first use and removed when the process that made it exits."""
        with self._lock:
            if self._root is None:
                self._root = Path(tempfile.mkdtemp(prefix="flashspec-sessions-"))
                atexit.register(shutil.rmtree, self._root, True)
            return self._root

    def folder(self, session_id: str) -> Path:
        """This session's folder (made if needed), marked as the most recently written; the least recently
        written ones beyond `keep` are removed."""
        path = self._path(session_id)
        with self._lock:
            path.mkdir(exist_ok=True)
            os.utime(path)
            for old in self.folders()[:-self.keep]:
                shutil.rmtree(old, ignore_errors=True)
        return path

    def remove(self, session_id: str) -> None:
        shutil.rmtree(self._path(session_id), ignore_errors=True)

    def folders(self) -> list[Path]:
        """Session folders, least recently written first."""
        def written(p: Path) -> float:
            try:
                return p.stat().st_mtime
            except FileNotFoundError:
                return 0.0

        return sorted((p for p in self.root.iterdir() if p.is_dir()), key=written)

    def _path(self, session_id: str) -> Path:
        if not isinstance(session_id, str) or not session_id.isalnum():
            raise ValueError(f"a session id is letters and digits, got {str(session_id)[:40]!r}")
        return self.root / session_id


FOLDERS = SessionFolders()
