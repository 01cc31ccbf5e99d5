"""The command line every benchmark shares: ``--repeats``, its sizes (``--<size>``, into its spec), its own options,
then which contenders, where the tables go, ``--tiny`` and the bound of a measurement (:func:`parse`)."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from benchmarks.workload import Spec

# The default folder of the tables: benchmarks/results.
RESULTS = str(Path(__file__).resolve().parent / "results")


def add_run_options(parser: argparse.ArgumentParser, contenders: Iterable[str], default_name: str) -> None:
    """The options of every benchmark this harness runs: which contenders, where the tables go, --tiny, the bound."""
    parser.add_argument("--contenders", default=",".join(contenders), help="comma-separated, default all")
    parser.add_argument("--out", default=RESULTS, help="directory for the tables")
    parser.add_argument("--name", default=None, help=f"file name of the tables (default: {default_name})")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: checks the harness, measures nothing useful")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one measurement may take (900)")


def parse_run_options(
    parser: argparse.ArgumentParser, argv: list[str] | None, contenders: Iterable[str]
) -> argparse.Namespace:
    """``parser``'s arguments from ``argv``; a contender not in ``contenders`` is an error naming those there are."""
    return check_contenders(parser, parser.parse_args(argv), contenders)


def check_contenders(
    parser: argparse.ArgumentParser, args: argparse.Namespace, contenders: Iterable[str]
) -> argparse.Namespace:
    """``args``, whose ``--contenders`` must all be in ``contenders``; else the parser fails naming those there are."""
    unknown = sorted(set(args.contenders.split(",")) - set(contenders))
    if unknown:
        parser.error(f"unknown contender(s) {unknown}; choose from {sorted(contenders)}")
    return args


SpecT = TypeVar("SpecT", bound=Spec)


def sized(spec: SpecT, sizes: dict[str, Any]) -> SpecT:
    """``spec`` with the sizes given on the command line, as ``argparse`` typed them (``None``: keep the spec's)."""
    for name, value in sizes.items():
        if value is not None:
            setattr(spec, name, value)
    return spec


def add_sizes(parser: argparse.ArgumentParser, sizes: dict[str, str], kind: type = int) -> None:
    """A ``--<size>`` option per entry of ``sizes`` (its help, the default in brackets); None keeps the spec's."""
    for size, help in sizes.items():
        parser.add_argument("--" + size.replace("_", "-"), type=kind, default=None, help=help)


def parse(
    argv: list[str] | None,
    description: str | None,
    prefix: str,
    contenders: Iterable[str],
    spec_class: Any,
    sizes: dict[str, str],
    repeats: tuple[int, str] = (3, "fresh driver processes per contender (default 3)"),
    floats: dict[str, str] | None = None,
    options: Iterable[tuple[str, dict[str, Any]]] = (),
    check: Callable[[argparse.Namespace, Any], str | None] | None = None,
) -> argparse.Namespace:
    """A benchmark's command line: ``--repeats``, a ``--<size>`` per entry of ``sizes`` (``floats``: of float sizes),
    its own ``options`` (flag, ``add_argument``'s keywords), then :func:`add_run_options`. ``args.spec`` is
    ``spec_class`` (``.tiny()`` with ``--tiny``) with the sizes given; ``check(args, spec)`` may finish it and names
    what makes the run impossible (the parser fails with it)."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=repeats[0], help=repeats[1])
    add_sizes(parser, sizes)
    add_sizes(parser, floats or {}, float)
    for flag, keywords in options:
        parser.add_argument(flag, **keywords)
    add_run_options(parser, contenders, f"{prefix}-<start time>")
    args = parse_run_options(parser, argv, contenders)
    args.spec = sizes_of(args, spec_class.tiny() if args.tiny else spec_class(), {**sizes, **(floats or {})})
    problem = check(args, args.spec) if check else None
    if problem:
        parser.error(problem)
    return args


def sizes_of(args: argparse.Namespace, spec: SpecT, sizes: Iterable[str]) -> SpecT:
    """``spec`` with the sizes of ``sizes`` given on the command line."""
    return sized(spec, {size: getattr(args, size) for size in sizes})
