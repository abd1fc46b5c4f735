"""Connects name-keyed handlers to components: inputs are passed by name, yielded {name: value} updates are
mapped to {component: value}; `wire` attaches such a handler to an event.

Also the Hugging Face Spaces GPU decorator (a no-op where `spaces` is absent, or on hardware other than
ZeroGPU). It wraps the name-keyed handler itself, so on ZeroGPU all of a run's torch work happens inside the
decorated function (in the forked worker that `spaces` runs it in), and what crosses the process boundary is
plain data: the handler's arguments and its {name: value} updates, mapped to components back in the server.
"""
from __future__ import annotations

import inspect
import os

import gradio as gr

try:  # on Hugging Face Spaces (ZeroGPU); import before anything initialises CUDA
    import spaces

    gpu = spaces.GPU
except ImportError:
    def gpu(fn):
        return fn


def on_zero_gpu(environ=os.environ) -> bool:
    """True on ZeroGPU hardware (what `spaces` itself reads): there GPU calls run in a forked worker process."""
    return environ.get("SPACES_ZERO_GPU", "").lower() in ("1", "t", "true")


def bind(handler, ui: dict, inputs: list[str], outputs: list[str] = ()):
    """A gradio callback that calls handler(**{name: value}) and maps its {name: value} updates onto ui; an empty
    update leaves every output as it is (gradio would read an empty dict as a missing value).

    A handler that takes `progress` gets gradio's progress tracker (a loading bar over the outputs): gradio
    finds it as a positional parameter with a gr.Progress() default, after the inputs. One that takes `request`
    gets the gr.Request of the event (gradio finds it by its annotation).
    """
    signature = inspect.signature(handler)
    signature.bind_partial(**dict.fromkeys(inputs))  # a TypeError now, at build time, for a misnamed input
    extras = [name for name in ("progress", "request") if name in signature.parameters]

    def call(args):
        named = dict(zip(inputs, args))
        named.update(zip(extras, args[len(inputs):]))
        return handler(**named)

    def components(update: dict) -> dict | None:
        if not update:  # gradio reads an empty dict as one (missing) value
            return {ui[outputs[0]]: gr.skip()} if outputs else None
        return {ui[name]: value for name, value in update.items()}

    if inspect.isgeneratorfunction(handler):
        def callback(*args):
            for update in call(args):
                yield components(update)
    else:
        def callback(*args):
            return components(call(args))
    params = [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in inputs]
    if "progress" in extras:
        params.append(inspect.Parameter("progress", inspect.Parameter.POSITIONAL_OR_KEYWORD, default=gr.Progress()))
    if "request" in extras:
        params.append(inspect.Parameter("request", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=gr.Request))
    callback.__signature__ = inspect.Signature(params)
    callback.__annotations__ = {"request": gr.Request} if "request" in extras else {}  # gradio reads the hint here
    callback.__name__ = callback.__qualname__ = handler.__name__
    callback.__doc__ = handler.__doc__
    return callback


def wire(listener, handler, ui: dict, inputs: list[str], outputs: list[str], on_gpu: bool = False, **kwargs):
    """Attach handler to an event listener (e.g. button.click), inputs and outputs given by name; on_gpu wraps
    the handler in the Spaces GPU decorator."""
    fn = bind(gpu(handler) if on_gpu else handler, ui, inputs, outputs)
    return listener(fn, [ui[n] for n in inputs], [ui[n] for n in outputs], **kwargs)
