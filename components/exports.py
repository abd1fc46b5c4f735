"""A session's temporary files (its exported runs): one folder per session inside one app-wide folder, removed
when the session's state is deleted (gradio does that after the tab closes, or after the state's time to live)
or when the session clears its runs; never to make room for another session.

Limits are per session and in total, by size: a session keeps only its latest export (at most
`session_bytes`), and an export that would take all sessions' files past `total_bytes` is not written (that
session's downloads stay off until space frees up), so no client can take another's files away.

The app-wide folder is registered with gradio as static (`gr.set_static_paths`), so the download buttons
serve these files where they are: no copy of each export piles up in gradio's own cache. Folder names are
random (uuid4), so one session cannot guess another's.
"""
from __future__ import annotations

import atexit
import shutil
import tempfile
import threading
from pathlib import Path

MB = 1 << 20


class SessionFolders:
    """Session folders under one root; the file system is the registry, so a forked worker (ZeroGPU) and the
    main process agree on it."""

    def __init__(self, session_bytes: int = 32 * MB, total_bytes: int = 1024 * MB, root: Path | None = None):
        self.session_bytes, self.total_bytes = session_bytes, total_bytes
        self._root = root
        self._lock = threading.RLock()  # folder() and admit() hold it while root and sizes are read

    @property
    def root(self) -> Path:
        """The app-wide folder, made on first use and removed when the process that made it exits."""
        with self._lock:
            if self._root is None:
                self._root = Path(tempfile.mkdtemp(prefix="flashspec-sessions-"))
                atexit.register(shutil.rmtree, self._root, True)
            return self._root

    def folder(self, session_id: str) -> Path:
        """This session's folder, made if needed and emptied of its earlier export."""
        path = self._path(session_id)
        with self._lock:
            path.mkdir(exist_ok=True)
            for old in path.iterdir():
                old.unlink(missing_ok=True)
        return path

    def admit(self, session_id: str) -> str | None:
        """After a session wrote its export: None when it fits the limits, else why not (its files are removed)."""
        with self._lock:
            mine = size(self._path(session_id))
            why = (f"this session's export is over {self.session_bytes // MB} MB" if mine > self.session_bytes else
                   "the server's space for exports is full" if self.nbytes() > self.total_bytes else None)
            if why:
                self.remove(session_id)
            return why

    def remove(self, session_id: str) -> None:
        shutil.rmtree(self._path(session_id), ignore_errors=True)

    def folders(self) -> list[Path]:
        return [p for p in self.root.iterdir() if p.is_dir()]

    def nbytes(self) -> int:
        """Bytes of every session's files."""
        return sum(size(p) for p in self.folders())

    def _path(self, session_id: str) -> Path:
        if not isinstance(session_id, str) or not session_id.isalnum():
            raise ValueError(f"a session id is letters and digits, got {str(session_id)[:40]!r}")
        return self.root / session_id


def size(folder: Path) -> int:
    """Bytes of the files in a folder (0 when it is gone)."""
    total = 0
    try:
        for f in folder.iterdir():
            try:
                total += f.stat().st_size
            except FileNotFoundError:
                pass
    except FileNotFoundError:
        pass
    return total


FOLDERS = SessionFolders()
