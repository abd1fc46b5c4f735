"""The Gradio panels of the FlashSpec demo, their pure formatters and their event handlers.

Each panel module exposes `build_<panel>()` returning its components by name; handlers (components.handlers)
yield dicts of updates keyed by those names, and `components.wiring.bind` connects the two.
"""
