"""The options page (``docs/options.md``), written from the same docstrings as ``hf-noloco-train --help``.

``python -m hf_noloco.launch.options_doc > docs/options.md`` regenerates it; a test fails when the committed
page differs from what the docstrings say.
"""

from __future__ import annotations

import inspect
import re

from hf_noloco.docstrings import docstring_entries

_ENTRY = re.compile(r"^(\w+) \((.*)\):$")


def _sections(cls) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """``[(group title, [(name, type and default, description)])]`` of a class's ``Parameters:`` section, in
    the docstring's order; ``> Title`` lines start a group."""
    entries = docstring_entries(cls.__doc__)
    sections: list[tuple[str, list]] = [("", [])]
    in_parameters = False
    for line in inspect.cleandoc(cls.__doc__ or "").splitlines():
        stripped = line.strip()
        if stripped == "Parameters:":
            in_parameters = True
        elif in_parameters and stripped.startswith("> "):
            sections.append((stripped[2:], []))
        elif in_parameters and (match := _ENTRY.match(stripped)):
            sections[-1][1].append((match.group(1), match.group(2), entries[match.group(1)]))
    return [(title, rows) for title, rows in sections if rows]


def _intro(cls) -> str:
    doc = inspect.cleandoc(cls.__doc__ or "")
    return " ".join(doc.split("Parameters:")[0].split())


def options_page() -> str:
    from hf_noloco.config import NoLoCoConfig
    from hf_noloco.data.arguments import DataArguments
    from hf_noloco.launch.arguments import ModelArguments

    lines = [
        "# Options",
        "",
        "Every option of `hf-noloco-train` (and of a recipe), by the class that declares it. "
        "`hf-noloco-train --help` prints the same texts. Every option of `transformers.TrainingArguments` "
        "is accepted too, except those `NoLoCoTrainer` would silently ignore, which are refused by name.",
        "",
        "This page is generated from the classes' docstrings "
        "(`python -m hf_noloco.launch.options_doc > docs/options.md`); a test keeps it in step.",
    ]
    for cls in (NoLoCoConfig, ModelArguments, DataArguments):
        lines += ["", f"## {cls.__name__}", "", _intro(cls)]
        for title, rows in _sections(cls):
            if title:
                lines += ["", f"### {title}"]
            lines.append("")
            for name, kind, text in rows:
                lines.append(f"- **`{name}`** ({kind}): {text}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(options_page(), end="")
