"""The `tkopt` command (also `python -m tkopt`): optimize, bench, demo, coverage, fetch-headers.

A subcommand is a function that adds its parser to the subparsers and sets `run` (args -> exit code); list
it in SUBCOMMANDS. Every subcommand takes the same -v/--verbose, -q/--quiet and --debug. A failure the CLI
foresees (bad model file, bad output path, unknown pass name, a missing compiler) prints one line
`tkopt: error: ...` and exits 2 (3: fused outputs differ from the original); any other prints one line too,
saying that --debug shows the traceback. Options that take values are consistent: `--disable` is repeatable
and comma-separated; `--json` prints JSON to stdout and `--json=FILE` writes it to FILE, in every subcommand.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

EXIT_ERROR = 2
EXIT_ACCURACY = 3
STDOUT = "-"  # --json without =FILE


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("tkopt")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


# ---- shared options -------------------------------------------------------------------------------
def _add_common(p: argparse.ArgumentParser, verbose_help: str) -> None:
    p.add_argument("-v", "--verbose", action="store_true", help=verbose_help + "; TileLang's log lines")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr (none without a terminal)")
    p.add_argument("--debug", action="store_true", help="show the traceback of an error")


def _pass_names(text: str) -> list[str]:
    return [name.strip() for name in text.split(",") if name.strip()]


def _add_disable(p: argparse.ArgumentParser) -> None:
    p.add_argument("--disable", action="extend", type=_pass_names, default=[], metavar="NAME[,NAME]",
                   help="passes to skip (repeatable; `tkopt optimize --list-passes` lists them)")


def _add_json(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--json", nargs="?", metavar="FILE", help=f"print {what} as JSON instead of tables; "
                   "--json=FILE writes the JSON to FILE and prints the tables")


def _add_target(p: argparse.ArgumentParser, help_: str) -> None:
    from tkopt.ort.library import CHOICES

    p.add_argument("--target", choices=CHOICES, default="auto", help=help_)


def _add_select(p: argparse.ArgumentParser) -> None:
    p.add_argument("--select", choices=("measured", "all"),
                   help="measured: keep a fusion (and the fused model) only where it measured faster than ORT's "
                   "own kernels (the default where the target's library runs here); all: keep every fusion")


TARGET_HELP = ("build the native ONNX Runtime op library the fused nodes run on, for this target (default auto: "
               "this machine's GPU arch where nvcc and onnxruntime-gpu are present, else cpu); none: no library, "
               "so ONNX Runtime cannot load the output (tkopt.run_model can)")


def _json_argv(argv: list[str]) -> list[str]:
    """A bare `--json` becomes `--json=-`, so that it never takes the next word (the model) as its FILE."""
    out: list[str] = []
    for i, a in enumerate(argv):
        if a == "--":
            return out + argv[i:]
        out.append(f"--json={STDOUT}" if a == "--json" else a)
    return out


def _json_file(args: argparse.Namespace) -> Path | None:
    """The --json=FILE path, checked before any work; None for none or stdout."""
    from tkopt.files import check_output

    if args.json in (None, STDOUT):
        return None
    return check_output(args.json, what="--json file", source=getattr(args, "model", None))


def _write_json(path: Path, text: str) -> None:
    from tkopt.files import write_atomic

    write_atomic(path, text.encode())
    print(f"wrote {path}")


# ---- optimize and demo ----------------------------------------------------------------------------
def _optimize_model(args: argparse.Namespace, model: Path, output: Path) -> int:
    from rich.console import Console

    from tkopt.api import AccuracyError, optimize_onnx
    from tkopt.report import last_report

    json_file = _json_file(args)
    mismatch = None
    try:
        _, rep = optimize_onnx(model, output, disable=args.disable, report=False,
                               check_accuracy=not args.no_check_accuracy, target=args.target, select=args.select,
                               force=getattr(args, "force", False))
    except AccuracyError as e:  # the report first: its accuracy table shows where
        rep, mismatch = last_report(), e
    if args.json == STDOUT:
        print(rep.to_json())
    else:
        rep.render(Console(), verbose=args.verbose)
        if json_file is not None:
            _write_json(json_file, rep.to_json())
    if mismatch is not None:
        print(f"tkopt: error: {mismatch}; nothing was written", file=sys.stderr)
        return EXIT_ACCURACY
    return 0


def _run_optimize(args: argparse.Namespace) -> int:
    if args.list_passes:
        from tkopt.passes.pipeline import all_passes

        for name, _, fusion in all_passes():
            print(f"{name}\t{'fusion' if fusion else 'canonicalization'}")
        return 0
    if args.model is None:
        raise ValueError("give a model file (tkopt optimize model.onnx) or --list-passes")
    model = Path(args.model)
    output = Path(args.output) if args.output else model.with_name(f"{model.stem}.tkopt.onnx")
    return _optimize_model(args, model, output)


def _add_optimize_options(p: argparse.ArgumentParser) -> None:
    _add_target(p, TARGET_HELP)
    _add_select(p)
    _add_disable(p)
    _add_json(p, "the report")
    p.add_argument("--no-check-accuracy", action="store_true", help="skip the fused-vs-unfused comparison")
    _add_common(p, "list every fused node with its times, every refusal with its reason, and all op counts")


def _add_optimize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("optimize", help="fuse an ONNX model and write the optimized model")
    p.add_argument("model", nargs="?", help="input .onnx file")
    p.add_argument("-o", "--output", help="output file (default: <stem>.tkopt.onnx next to the input); its "
                   "external data and op library are written beside it")
    p.add_argument("--force", action="store_true", help="let -o name the input model itself (overwrite it)")
    p.add_argument("--list-passes", action="store_true", help="list the pass names (for --disable) and exit")
    _add_optimize_options(p)
    p.set_defaults(run=_run_optimize)


def _run_demo(args: argparse.Namespace) -> int:
    from tkopt import logs, progress
    from tkopt.models.export import export_example

    with contextlib.ExitStack() as stack:
        if args.workdir:
            workdir = Path(args.workdir)
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="tkopt-demo-")))
        with progress.step("exporting the example model (a GPT-2-style block) with torch.onnx, dynamo=True"), \
                logs.quiet_exporters():
            model = export_example(workdir / "example.onnx")
        if args.json != STDOUT:
            print(f"exported the example model to {model}"
                  + ("" if args.workdir else " (a temporary folder, removed at the end; --workdir DIR keeps it)"))
        return _optimize_model(args, model, model.with_name(f"{model.stem}.tkopt.onnx"))


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="export the bundled example model, optimize it, show report and accuracy")
    p.add_argument("--workdir", help="keep the models in this folder (default: a temporary one, removed after)")
    _add_optimize_options(p)
    p.set_defaults(run=_run_demo)


# ---- bench ----------------------------------------------------------------------------------------
def _run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tkopt.bench import bench_onnx

    json_file = _json_file(args)
    result = bench_onnx(args.model, target=args.target, runs=args.runs, warmup=args.warmup,
                        disable=args.disable, seed=args.seed, nodes=not args.no_nodes, select=args.select)
    if args.json == STDOUT:
        print(result.to_json())
    else:
        result.render(Console())
        if json_file is not None:
            _write_json(json_file, result.to_json())
    return 0 if result.ok else EXIT_ACCURACY


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="fused vs unfused: errors and latency, per output and per fused node")
    p.add_argument("model", help="input .onnx file")
    _add_target(p, "run the fused model on the native op library built for this target (default auto: this "
                "machine's GPU arch where nvcc and onnxruntime-gpu are present, else cpu); none: fused ops run "
                "their torch references, accuracy only")
    _add_select(p)
    _add_disable(p)
    p.add_argument("--runs", type=int, default=20, help="timed runs per variant (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    _add_json(p, "every number")
    p.add_argument("--no-nodes", action="store_true", help="skip the per-fused-node rows")
    _add_common(p, "more detail")
    p.set_defaults(run=_run_bench)


# ---- coverage and fetch-headers -------------------------------------------------------------------
def _run_coverage(args: argparse.Namespace) -> int:
    from tkopt.coverage import ENTRIES, markdown, run
    from tkopt.files import check_output, write_atomic

    out = check_output(args.out, what="--out file") if args.out else None

    def progress(cell: Any) -> None:  # tkopt.coverage.Cell, imported lazily
        if args.quiet:
            return
        state = "error" if cell.error else f"{cell.fusions} max rel {cell.max_rel:.1e}"
        print(f"{cell.model} · {ENTRIES[cell.entry]}: {state}", file=sys.stderr, flush=True)

    rows, cells = run(args.models, args.entries, progress)
    command = "tkopt coverage" + "".join(f" --{k} {' '.join(v)}" for k, v in
                                         (("models", args.models), ("entries", args.entries)) if v)
    text = markdown(rows, cells, command)
    if out is not None:
        write_atomic(out, text.encode())
        print(f"wrote {out}")
    else:
        print(text)
    return 0


def _add_coverage(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("coverage", help="real models (tiny random configs) through every entry point, on CPU: "
                       "fusions per layer, parity with eager, refusal reasons")
    p.add_argument("--models", nargs="+", metavar="NAME", help="rows to run (default: all)")
    p.add_argument("--entries", nargs="+", metavar="NAME", help="columns to run (default: all): compile, "
                   "backend, backend_train, onnx_static, onnx_dynamic, onnx_torchscript")
    p.add_argument("--out", help="write the Markdown table to this file (default: print it)")
    _add_common(p, "more detail")
    p.set_defaults(run=_run_coverage)


def _run_fetch_headers(args: argparse.Namespace) -> int:
    from tkopt.ort.headers import include_dir

    print(include_dir())
    return 0


def _add_fetch_headers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fetch-headers", help="fetch ONNX Runtime's C API headers (npm) for building op libraries")
    _add_common(p, "more detail")
    p.set_defaults(run=_run_fetch_headers)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_optimize, _add_bench, _add_demo,
                                                                    _add_coverage, _add_fetch_headers]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tkopt", description="Graph-level fusion optimizer for ONNX and PyTorch")
    parser.add_argument("--version", action="version", version=f"tkopt {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def _foreseen() -> tuple[type[BaseException], ...]:
    """Errors whose message says all there is: bad input, missing tools, build and load failures."""
    from tkopt.ort.headers import HeadersError
    from tkopt.ort.native import LibraryBuildError
    from tkopt.ort.session import OpLibraryError

    return ValueError, OSError, HeadersError, LibraryBuildError, OpLibraryError


def _warning_line(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
                  line: str | None = None) -> None:
    """tkopt's own warnings (a node left unfused, and why) as one line; others' (exporters, TileLang) only with
    --verbose, where Python's usual form shows them."""
    text = str(message)
    if text.startswith("tkopt: "):
        print(f"tkopt: warning: {text.removeprefix('tkopt: ')}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    from tkopt import logs, progress

    args = build_parser().parse_args(_json_argv(list(sys.argv[1:] if argv is None else argv)))
    progress.set_quiet(args.quiet)
    logs.set_verbose(args.verbose)
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _warning_line if not args.verbose else warnings.showwarning
            return args.run(args)
    except KeyboardInterrupt:
        print("tkopt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `tkopt ... | head`: the reader left; say nothing more
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # noqa: BLE001 - the CLI's one line; --debug shows the traceback
        if args.debug:
            raise
        lines = [ln for ln in str(e).splitlines() if ln.strip()]
        msg = " ".join(lines[0].split()) if lines else type(e).__name__
        if not isinstance(e, _foreseen()):
            msg = f"{type(e).__name__}: {msg} (run with --debug for the traceback)"
        elif len(lines) > 1:
            msg += " (--debug shows the rest)"
        print(f"tkopt: error: {msg}", file=sys.stderr)
        return EXIT_ERROR
    finally:
        logs.set_verbose(False)
        progress.set_quiet(False)


if __name__ == "__main__":
    sys.exit(main())
