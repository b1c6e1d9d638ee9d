"""Options declared once (no torch, no runtime import).

An option group is a frozen dataclass; each field that users set is declared with
:func:`option`: its default, its command-line flag, its help, and whether it shapes the export
contract. The command line (``cli.py``) builds its options from these declarations, the Python
API takes the dataclass itself, and code that needs "the contract-shaping options" reads them
from the metadata (:func:`declared`), so no option is spelled twice.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Declared", "declared", "option"]


def option(
    default: Any,
    flag: str,
    help: str,
    *,
    contract: bool = False,
    parse: Callable[[str], Any] | None = None,
    env: str | None = None,
) -> Any:
    """A dataclass field with ``default`` that users set with ``flag`` (e.g. ``"--max-seq-len"``;
    ``"--x/--no-x"`` for a switch).

    Args:
        help: one line for ``--help`` (the CLI appends the default).
        contract: the option shapes the export contract (it is written to the manifest under the
            field's name, and a one-graph re-export must keep it).
        parse: turns the command-line text into the value (e.g. a comma-separated list); the CLI
            reads a plain string then.
        env: an environment variable the CLI reads when the flag is not given (e.g. a secret).
    """
    return dataclasses.field(
        default=default,
        metadata={
            "flag": flag,
            "help": help,
            "contract": contract,
            "parse": parse,
            "env": env,
        },
    )


@dataclass(frozen=True)
class Declared:
    """One declared option: the field's ``name``, ``default``, annotation ``type`` (resolved, e.g.
    ``int | None`` or a ``StrEnum`` class), and its declaration (see :func:`option`)."""

    name: str
    default: Any
    type: Any
    flag: str
    help: str
    contract: bool
    parse: Callable[[str], Any] | None
    env: str | None


def declared(group: type) -> list[Declared]:
    """The declared options of the dataclass ``group``, in field order (fields made without
    :func:`option` are not options users set and are left out)."""
    hints = typing.get_type_hints(group)
    return [
        Declared(
            f.name,
            f.default,
            hints[f.name],
            f.metadata["flag"],
            f.metadata["help"],
            f.metadata["contract"],
            f.metadata["parse"],
            f.metadata["env"],
        )
        for f in dataclasses.fields(group)
        if "flag" in f.metadata
    ]
