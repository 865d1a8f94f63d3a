"""Options that declare their own command line: a method's options dataclass marks each field with
`flagged(default, help, parse=...)`, and cli_options.add_option_groups builds its argparse group and
reads it back into the dataclass from those marks. A knob is then written once, next to the proposer
that reads it: its type, default, range (the parse function and the dataclass's own checks) and help.

Also the argparse types every command uses: a bad value is one clear line, before anything loads.
Nothing here imports specdec, so any module may declare flagged options.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Flag:
    """How one options field appears on the command line: --GROUP-NAME (NAME: `name`, else the field's
    with - for _), parsed by `parse` (None: a switch, for a bool that defaults to False)."""

    help: str
    parse: Callable[[str], Any] | None = None
    metavar: str | None = None
    choices: tuple | None = None
    name: str | None = None


def flagged(default, help: str, *, parse: Callable[[str], Any] | None = None, metavar: str | None = None,
            choices: tuple | None = None, name: str | None = None):
    """A dataclass field with its command-line flag (cli_options.add_option_groups)."""
    return field(default=default, metadata={"flag": Flag(help, parse, metavar, choices, name)})


def flags_of(options: type) -> list[tuple[dataclasses.Field, Flag]]:
    """An options dataclass's flagged fields, in declaration order."""
    return [(f, f.metadata["flag"]) for f in dataclasses.fields(options) if "flag" in f.metadata]


def is_int(value) -> bool:
    """An int, not a bool (True is an int to Python, not a count to a user)."""
    return isinstance(value, int) and not isinstance(value, bool)


# ---- argparse types ----------------------------------------------------------------------------


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text}")
    return value


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text}")
    return value


def number_in(interval: str, contains: Callable[[float], bool]) -> Callable[[str], float]:
    """An argparse type: a float that `contains` accepts, else an error naming the interval."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan  # fails every comparison
        if not contains(value):
            raise argparse.ArgumentTypeError(f"must be a number in {interval}, got {text}")
        return value
    return parse


probability = number_in("[0, 1)", lambda v: 0.0 <= v < 1.0)
positive_float = number_in("(0, inf)", lambda v: 0.0 < v < math.inf)
