"""One entry per method (proposers/registry.py: MethodEntry): what reads the entries agrees with them,
and the README's table of methods describes each one's needs as its entry does."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specdec.bench.harness import TREE_METHODS
from specdec.cli import build_parser
from specdec.config import SpecConfig, option_groups
from specdec.option_fields import flags_of
from specdec.proposers.lookahead import LookaheadOptions
from specdec.proposers.registry import BESIDE_ANY_METHOD, ENTRIES, METHODS, build_proposer, methods_reading

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_rows() -> dict[str, str]:
    """The README's table of methods: method -> its "needs" cell."""
    rows = {}
    for line in README.read_text().splitlines():
        match = re.match(r"\| `([a-z0-9+-]+)` \| [^|]+ \| ([^|]+) \|", line)
        if match and match.group(1) in ENTRIES:
            rows[match.group(1)] = match.group(2)
    return rows


def test_the_readme_table_has_every_method_and_its_needs():
    rows = readme_rows()
    shipped = [name for name, method in ENTRIES.items() if not method.plugin]
    assert sorted(rows) == sorted(shipped)
    for name in shipped:
        method = ENTRIES[name]
        needs = rows[name]
        assert ("draft model" in needs) == method.needs_draft_model, name
        assert ("head" in needs) == (method.head_kind is not None), name


def test_what_reads_the_entries_agrees_with_them():
    assert list(METHODS) == list(ENTRIES) and all(METHODS[name] == ENTRIES[name].description for name in ENTRIES)
    assert set(TREE_METHODS) == {name for name, method in ENTRIES.items() if method.default_tree_size is not None}
    assert set(BESIDE_ANY_METHOD) == {name for name, method in ENTRIES.items() if method.beside_any}
    for name, method in ENTRIES.items():
        assert SpecConfig(method=name).needs_draft_model == method.needs_draft_model
        assert SpecConfig(method=name).head_kind == method.head_kind
        assert {kind.GROUP for kind in method.options} <= set(option_groups()), name
    assert build_proposer("autoregressive") is None


def test_every_option_group_is_a_titled_cli_group_naming_its_methods():
    """Each flagged options dataclass of SpecConfig is one argparse group of `generate`, titled by the
    methods whose entries read it, and its flags set the config's fields."""
    generate = build_parser()._subparsers._group_actions[0].choices["generate"]
    titles = {group.title: group for group in generate._action_groups}
    for group_name, options in option_groups().items():
        if not flags_of(options):
            continue
        title = f"{options.TITLE} (--method {', '.join(methods_reading(options))})"
        assert title in titles, title
        flags = {option for action in titles[title]._group_actions for option in action.option_strings}
        assert len(flags) == len(flags_of(options)) and all(flag.startswith(f"--{group_name}-") for flag in flags)


@pytest.mark.parametrize("argv,field,expected", [
    (["--ngram-max", "5"], ("ngram", "max"), 5),
    (["--ngram-tie-break", "random"], ("ngram", "tie_break"), "random"),
    (["--suffix-min-prob", "0.3"], ("suffix", "min_token_prob"), 0.3),
    (["--copy-corpus-tokens", "0"], ("copy", "corpus_tokens"), 0),
    (["--copy-trees"], ("copy", "trees"), True),
    (["--lookahead-window", "7"], ("lookahead", "window"), 7),
])
def test_a_flag_reaches_its_field(argv, field, expected):
    from specdec.cli_options import config_from_args

    args = build_parser().parse_args(["generate", "--method", "ngram", *argv, "hello"])
    config = config_from_args(args, resolve=False)
    assert getattr(config.option(option_groups()[field[0]]), field[1]) == expected
    untouched = {name: options() for name, options in option_groups().items() if name != field[0]}
    assert all(config.option(type(default)) == default for default in untouched.values())


def test_lookahead_is_described_by_its_own_module_alone():
    """The entry form: lookahead decoding's name, options and builder live in proposers/lookahead.py;
    no other module of specdec names the method (a new method's module is as alone)."""
    source = Path(__file__).resolve().parents[2] / "src" / "specdec"
    naming = sorted(str(path.relative_to(source)) for path in source.rglob("*.py")
                    if '"lookahead"' in path.read_text() or "LookaheadOptions" in path.read_text())
    assert naming == ["proposers/lookahead.py"]
    assert ENTRIES["lookahead"].options == (LookaheadOptions,) and "lookahead" in option_groups()


def test_every_proposer_is_built_by_its_own_module_or_the_registry():
    """Replay, the factory and the server reach a proposer through build_proposer (replay's fixed
    costs through Build.replay_cost): no module of specdec but a proposer's own constructs it (a
    docstring's example may show a user doing so)."""
    source = Path(__file__).resolve().parents[2] / "src" / "specdec"
    proposer_modules = sorted((source / "proposers").glob("*.py"))
    classes = {match: path.name for path in proposer_modules
               for match in re.findall(r"^class (\w+Proposer)\b", path.read_text(), flags=re.M)}
    assert "ScoredCopyProposer" in classes and "NgramProposer" in classes
    def code(path: Path) -> str:
        return "\n".join(line for line in path.read_text().splitlines()
                         if not line.strip().startswith((">>>", "...")))

    built_elsewhere = sorted(f"{path.relative_to(source)}: {name}" for path in source.rglob("*.py")
                             if path.parent.name != "proposers" for name in classes
                             if re.search(rf"\b{name}\(", code(path)))
    assert built_elsewhere == []
