"""A griffe extension (mkdocs.yml, mkdocstrings' ``extensions``): read a docstring's
``Example:`` section as griffe reads ``Examples:``.

This package's docstrings head their doctests ``Example:`` (74 of them, and
tests/unit/test_doctests.py runs them); griffe's Google-style parser turns only
``Examples:`` into code, and renders ``Example:`` as an admonition of running text.
"""

from __future__ import annotations

import re

import griffe

_SINGULAR = re.compile(r"^(\s*)Example:[ \t]*$", flags=re.M)


class ExampleSections(griffe.Extension):
    def on_object(self, *, obj, **kwargs) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _SINGULAR.sub(r"\1Examples:", obj.docstring.value)
