"""How a config key is declared: ``config_field(default, doc, check=..., env=...)``, and the checks.

``doc`` is what ``python -m trainer --help`` and docs/configuration.md show, ``check`` returns
what is wrong with a value (or None), ``env`` names an environment variable that overrides
the key. The sections themselves live in :mod:`trainer.config._schema` (and, one module per
larger section, :mod:`trainer.config._workers`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

__all__ = [
    "Check",
    "ConfigWarning",
    "at_least",
    "config_field",
    "config_section",
    "in_range",
    "module_attr",
    "positive",
]

Check = Callable[[Any], str | None]


class ConfigWarning(UserWarning):
    """A configuration that works but is probably not what was meant."""


def config_field(
    default: Any, doc: str, *, check: Check | None = None, env: str | None = None
) -> Any:
    """An attrs field that carries its doc, its check and its environment override."""
    return attrs.field(default=default, metadata={"doc": doc, "check": check, "env": env})


def config_section(cls: type, doc: str, *, switch: str | None = None) -> Any:
    """A nested section (``cls()`` by default). ``switch``: the ``key=VALUE`` that turns the
    section's feature on, where no ``.enable`` key does (the loader answers
    ``SECTION.enable`` with it)."""
    return attrs.field(factory=cls, metadata={"doc": doc, "switch": switch})


def at_least(lo: float) -> Check:
    return lambda v: None if v is None or v >= lo else f"must be >= {lo:g}"


def positive(v: Any) -> str | None:
    return None if v is None or v > 0 else "must be > 0"


def in_range(lo: float, hi: float) -> Check:
    return lambda v: None if v is None or lo <= v <= hi else f"must be in [{lo:g}, {hi:g}]"


def module_attr(v: Any) -> str | None:
    if v is None or (isinstance(v, str) and v.count(":") == 1 and all(v.split(":"))):
        return None
    return "must be 'package.module:Name'"
