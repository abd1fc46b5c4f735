"""A session's temporary files: one folder per session, kept while the session lives, limited per session and in
total by size (a refused export is removed, never another session's), removed by Clear and with the session."""
import pytest

from components.compact import LOADED
from components.exports import SessionFolders
from components.runs import Run, run_record
from components.session import ExportRefused, Session, forget


def test_limits_are_per_session_and_in_total_never_by_count(tmp_path):
    folders = SessionFolders(session_bytes=100, total_bytes=250, root=tmp_path)
    for i in range(12):  # more sessions than any count limit would keep: all stay
        (folders.folder(f"s{i}") / "f.json").write_text("x" * 20)
        assert folders.admit(f"s{i}") is None
    (folders.folder("big") / "f.json").write_text("x" * 101)
    assert folders.admit("big") == "this session's export is over 0 MB" and not (tmp_path / "big").exists()
    (folders.folder("s12") / "f.json").write_text("x" * 99)
    assert folders.admit("s12") == "the server's space for exports is full" and not (tmp_path / "s12").exists()
    assert len(folders.folders()) == 12  # the others' files are untouched
    (folders.folder("s0") / "g.json").write_text("y")  # a new export replaces the session's earlier one
    assert [p.name for p in (tmp_path / "s0").iterdir()] == ["g.json"]
    folders.remove("s2")
    assert len(folders.folders()) == 11
    with pytest.raises(ValueError, match="letters and digits"):
        folders.folder("../etc")


def test_a_session_replaces_its_export_clears_it_and_forgets_it_at_the_end(monkeypatch, tmp_path):
    from components import session

    monkeypatch.setattr(session, "FOLDERS", SessionFolders(root=tmp_path))
    state = Session()
    first = state.exports()
    second = state.exports()
    assert [p.name for p in second] == ["flashspec_runs_2.csv", "flashspec_runs_2.json"]
    assert not first[0].exists() and second[0].exists()
    state.clear()
    assert not (tmp_path / state.id).exists()
    state.exports()
    assert Session().id != state.id
    forget(state)
    assert not (tmp_path / state.id).exists()


def test_an_export_over_the_limit_is_refused_with_its_reason(monkeypatch, tmp_path):
    from components import session

    monkeypatch.setattr(session, "FOLDERS", SessionFolders(session_bytes=10, root=tmp_path))
    state = Session()
    state.add(Run(run_record("run 1", "plain", {}, {}), "hi"))
    with pytest.raises(ExportRefused, match="this session's export is over"):
        state.exports()
    assert not (tmp_path / state.id).exists()
    assert LOADED.names(state.id) == set()
