import json

import pytest

from components.prompt import EXAMPLES_PATH, example_by_name, load_examples


def test_examples_cover_the_eight_kinds():
    examples = load_examples()
    assert {ex["kind"] for ex in examples} == {"code edit", "rename", "summary", "document QA", "open chat", "story",
                                                "explanation", "long repetitive answer"}
    for ex in examples:
        assert ex["prompt"].strip() and 1 <= ex["max_new_tokens"] <= 1024


def test_example_by_name():
    examples = load_examples(EXAMPLES_PATH)
    assert example_by_name(examples, examples[1]["name"]) is examples[1]
    assert example_by_name(examples, "no such example") is None


def test_malformed_examples_are_refused(tmp_path):
    path = tmp_path / "examples.json"
    path.write_text(json.dumps([{"name": "a", "prompt": "p"}]))
    with pytest.raises(ValueError, match="lacks"):
        load_examples(path)
    ex = {"name": "a", "kind": "k", "prompt": "p", "max_new_tokens": 4}
    path.write_text(json.dumps([ex, ex]))
    with pytest.raises(ValueError, match="unique"):
        load_examples(path)
