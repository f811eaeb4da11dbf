"""The one docstring convention of the settings classes: a field's ``--help`` text is its entry in the class's
``Parameters:`` section (``name (`type`, ...):`` then an indented description; ``> Title`` lines group them),
so there is one text to read in two places, and ``docs/options.md`` is generated from the same entries.

This module imports nothing of the package: every layer may use it.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import types

_DOC_ENTRY = re.compile(r"^(\w+) \(.*\):$")


def docstring_entries(doc: str) -> dict[str, str]:
    """``{name: description}`` of a docstring's ``Parameters:`` entries (``name (`type`, ...):`` then an
    indented description), each description joined into one paragraph."""
    entries: dict[str, str] = {}
    name, indent = None, 0
    for line in inspect.cleandoc(doc or "").splitlines():
        stripped = line.strip()
        match = _DOC_ENTRY.match(stripped)
        if match:
            name, indent = match.group(1), len(line) - len(line.lstrip())
            entries[name] = ""
        elif name is not None and stripped and len(line) - len(line.lstrip()) > indent:
            entries[name] = f"{entries[name]} {stripped}".strip()
        elif stripped:
            name = None
    return entries


def is_package_field(cls, name: str) -> bool:
    """Whether field ``name`` of ``cls`` is declared by a class of this package (``cls`` itself or a base such
    as :class:`~hf_noloco.outer.settings.OuterSettings`), not by a third-party base: giving a help text to an
    inherited ``TrainingArguments`` field would change that field for every user of ``TrainingArguments``."""
    package = __name__.split(".")[0]
    return any(
        name in vars(base).get("__annotations__", {}) and base.__module__.split(".")[0] == package
        for base in cls.__mro__
    )


def help_from_docstring(cls):
    """Gives every field documented in ``cls``'s docstring that entry as its ``--help`` text (``%`` escaped:
    argparse formats help texts with ``%``)."""
    entries = docstring_entries(cls.__doc__)
    for f in dataclasses.fields(cls):
        if f.name in entries and is_package_field(cls, f.name):
            help_text = entries[f.name].replace("%", "%%")
            f.metadata = types.MappingProxyType({**f.metadata, "help": help_text})
    return cls
