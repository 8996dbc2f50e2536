"""The references some tests compare kvindex against, imported on first use.

transformers takes a noticeable part of a second to import; imported at module level it
was paid by every collection, even of tests that never touch it. A test that needs it
and runs where it is not installed skips.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

import pytest


def transformers() -> ModuleType:
    return pytest.importorskip("transformers")


def render_jinja_template(**kwargs: Any) -> Any:
    """transformers' own chat template renderer."""
    transformers()
    from transformers.utils.chat_template_utils import render_jinja_template as render

    return render(**kwargs)
