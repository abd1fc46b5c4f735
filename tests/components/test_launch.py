import os

import pytest

from components.launch import ALL, LOCAL, cache_config, parse_args, server_name
from flashspec_core.models import PUBLIC


def test_local_by_default_everywhere_on_spaces_or_share():
    assert server_name(None, False, {}) == LOCAL
    assert server_name(None, False, {"SPACE_ID": "user/flashspec"}) == ALL
    assert server_name(None, True, {}) == ALL
    assert server_name("192.168.1.5", True, {"SPACE_ID": "x"}) == "192.168.1.5"


def test_parse_args():
    args = parse_args(["--host", "0.0.0.0", "--port", "8000", "--share", "--no-preload"], environ={})
    assert (args.host, args.port, args.share, args.no_preload) == ("0.0.0.0", 8000, True, True)
    args = parse_args([], environ={})
    assert args.host is None and not args.share


def test_public_by_default_even_on_a_space():
    for environ in ({}, {"SPACE_ID": "user/flashspec"}):
        config = parse_args([], environ=environ).cache
        assert config.policy == PUBLIC and config.max_engines == 3 and config.max_gib == 8


def test_the_owner_opens_named_folders_and_pickles(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    config = parse_args(["--allow-local-models", str(a), str(b), "--allow-pickle", "--max-engines", "5"], environ={}).cache
    assert config.policy.local_roots == (str(a), str(b)) and config.policy.allow_pickle and config.max_engines == 5
    env = {"FLASHSPEC_LOCAL_MODELS": f"{a}{os.pathsep}{b}", "FLASHSPEC_ALLOW_PICKLE": "1",
           "FLASHSPEC_MAX_ENGINE_GB": "2.5"}
    config = cache_config(parse_args([], environ=env), env)
    assert config.policy.local_roots == (str(a), str(b)) and config.policy.allow_pickle and config.max_gib == 2.5


def test_a_folder_that_is_not_an_absolute_directory_stops_the_start(tmp_path, capsys):
    for bad in ("relative/dir", str(tmp_path / "missing")):
        with pytest.raises(SystemExit):
            parse_args(["--allow-local-models", bad], environ={})
        assert "is not an absolute path to a folder" in capsys.readouterr().err


def test_precision_from_the_option_or_the_environment(capsys):
    assert parse_args([], environ={}).cache.precision == "auto"
    assert parse_args(["--precision", "float32"], environ={}).cache.precision == "float32"
    assert parse_args([], environ={"FLASHSPEC_PRECISION": "gguf"}).cache.precision == "gguf"
    with pytest.raises(SystemExit):
        parse_args(["--precision", "int4"], environ={})
    assert "invalid choice: 'int4'" in capsys.readouterr().err
