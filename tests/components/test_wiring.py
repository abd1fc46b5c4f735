import inspect

import gradio as gr
import pytest

from components.wiring import bind, wire


def test_generator_handler_gets_named_inputs_and_its_updates_are_mapped():
    ui = {"a": object(), "b": object(), "out": object()}
    seen = {}

    def handler(a, b, progress=None):
        seen.update(a=a, b=b, progress=progress)
        yield {"out": a + b}
        yield {"out": a * b}

    callback = bind(handler, ui, ["a", "b"])
    assert inspect.isgeneratorfunction(callback)
    marker = object()
    assert list(callback(2, 3, marker)) == [{ui["out"]: 5}, {ui["out"]: 6}]
    assert seen == {"a": 2, "b": 3, "progress": marker}


def test_gradio_finds_the_progress_parameter():
    def handler(a, progress=None):
        yield {}

    params = list(inspect.signature(bind(handler, {}, ["a"])).parameters.values())
    assert [p.name for p in params] == ["a", "progress"]
    assert params[1].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD and isinstance(params[1].default, gr.Progress)


def test_plain_function_without_progress():
    ui = {"x": object()}
    callback = bind(lambda x: {"x": x + 1}, ui, ["x"])
    assert not inspect.isgeneratorfunction(callback)
    assert callback(1) == {ui["x"]: 2}
    assert list(inspect.signature(callback).parameters) == ["x"]


def test_misnamed_inputs_fail_at_build_time():
    with pytest.raises(TypeError, match="unexpected keyword argument 'b'"):
        bind(lambda a: {}, {}, ["a", "b"])


def test_wire_looks_components_up_by_name():
    ui = {"a": "A", "out": "OUT"}
    calls = []
    wire(lambda fn, inputs, outputs, **kw: calls.append((fn(1), inputs, outputs, kw)), lambda a: {"out": a},
         ui, ["a"], ["out"], concurrency_limit=1)
    assert calls == [({"OUT": 1}, ["A"], ["OUT"], {"concurrency_limit": 1})]


def test_gradio_finds_the_request_parameter():
    from gradio.utils import get_type_hints

    def handler(a, request=None):
        return {"out": request}

    callback = bind(handler, {"out": "OUT"}, ["a"], ["out"])
    assert list(inspect.signature(callback).parameters) == ["a", "request"]
    assert get_type_hints(callback) == {"request": gr.Request}
    assert callback(1, "the request") == {"OUT": "the request"}


def test_an_empty_update_leaves_the_outputs_as_they_are():
    callback = bind(lambda a: {}, {"out": "OUT"}, ["a"], ["out"])
    assert list(callback(1)) == ["OUT"] and isinstance(callback(1)["OUT"], type(gr.skip()))
