"""A session's temporary files: one folder per session, removed with the session or beyond `keep`."""
import os
import time

import pytest

from components.exports import SessionFolders
from components.session import Session, forget


def test_folders_beyond_keep_are_removed_least_recently_written_first(tmp_path):
    folders = SessionFolders(keep=3, root=tmp_path)
    made = [folders.folder(f"s{i}") for i in range(3)]
    past = time.time() - 100
    for i, path in enumerate(made):
        os.utime(path, (past + i, past + i))
    folders.folder("s0")  # written again: now the most recent
    folders.folder("s3")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s0", "s2", "s3"]
    folders.remove("s2")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s0", "s3"]
    with pytest.raises(ValueError, match="letters and digits"):
        folders.folder("../etc")


def test_a_session_replaces_its_export_and_forgets_it_at_the_end(monkeypatch, tmp_path):
    from components import session

    monkeypatch.setattr(session, "FOLDERS", SessionFolders(root=tmp_path))
    state = Session()
    first = state.exports()
    second = state.exports()
    assert [p.name for p in second] == ["flashspec_runs_2.csv", "flashspec_runs_2.json"]
    assert not first[0].exists() and second[0].exists()
    assert Session().id != state.id
    forget(state)
    assert not (tmp_path / state.id).exists()
