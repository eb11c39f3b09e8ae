"""A model's chat template rendered under a time bound.

A chat template is operator content (a Jinja program shipped in the model folder), and Jinja has loops: a template
that loops (``range(100000)`` nested twice) never answered and burnt a core long after the client had left. The
sandbox transformers renders it in bounds ranges and attributes, not time. :func:`render_chat_template` renders
it with a trace function on the compiled template's own frames (Jinja compiles to Python code whose file name is
``<template>``): each line it runs checks the deadline, and past it the render stops with :class:`TemplateTimeout`
(a ``jinja2`` ``TemplateError``, so callers that turn a template's errors into a 400 treat it the same). Frames of
other code are not traced (the global trace function returns None for them), and a trace function already set
(a debugger, coverage) is restored afterwards.
"""

from __future__ import annotations

import sys
import time

from jinja2.exceptions import TemplateError

__all__ = ["CHAT_TEMPLATE_SECONDS", "TemplateTimeout", "render_chat_template"]

#: the longest a chat template may take to render (real templates take milliseconds)
CHAT_TEMPLATE_SECONDS = 2.0
_TEMPLATE_FILES = ("<template>",)


class TemplateTimeout(TemplateError):
    """A chat template ran past its time bound."""


def render_chat_template(tokenizer, messages: list[dict], seconds: float = CHAT_TEMPLATE_SECONDS, **kw) -> str:
    """``tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)``, stopped with
    :class:`TemplateTimeout` once its template code has run ``seconds``."""
    deadline = time.monotonic() + seconds

    def check(frame, event, arg):
        if time.monotonic() > deadline:
            raise TemplateTimeout(f"the chat template ran past {seconds:g} s (a loop?); it was stopped")
        return check

    def calls(frame, event, arg):
        if frame.f_code.co_filename in _TEMPLATE_FILES:
            return check(frame, event, arg)
        return None

    before = sys.gettrace()
    sys.settrace(calls)
    try:
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kw)
    finally:
        sys.settrace(before)
