"""The `tkopt` command: `tkopt optimize model.onnx`, `tkopt demo`, and room for more subcommands.

A subcommand is a function that adds its parser to the subparsers and sets `run` (args -> exit
code); list it in SUBCOMMANDS. Expected failures (bad model file, unknown pass name, accuracy
mismatch) print one line `tkopt: error: ...` and exit non-zero; --verbose shows the traceback.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

EXIT_ERROR = 2
EXIT_ACCURACY = 3


def _optimize_model(args: argparse.Namespace, model: Path, output: Path) -> int:
    from rich.console import Console

    from tkopt.api import AccuracyError, optimize_onnx

    try:
        _, rep = optimize_onnx(model, output, disable=args.disable, report=False,
                               check_accuracy=not args.no_check_accuracy, target=args.target, select=args.select)
    except AccuracyError as e:
        print(f"tkopt: error: {e}", file=sys.stderr)
        return EXIT_ACCURACY
    if args.json:
        print(rep.to_json())
    else:
        rep.render(Console(), verbose=args.verbose)
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


def _add_optimize(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("optimize", help="fuse an ONNX model and write the optimized model")
    p.add_argument("model", nargs="?", help="input .onnx file")
    p.add_argument("-o", "--output", help="output file (default: <stem>.tkopt.onnx next to the input)")
    _add_common(p)
    p.add_argument("--list-passes", action="store_true", help="list the pass names (for --disable) and exit")
    _add_target(p, None)
    p.set_defaults(run=_run_optimize)


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--disable", nargs="+", default=[], metavar="NAME", help="passes to skip")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="list refusals with reasons and all op counts")
    p.add_argument("--no-check-accuracy", action="store_true", help="skip the fused-vs-unfused comparison")


def _add_target(p: argparse.ArgumentParser, default: str | None) -> None:
    p.add_argument("--target", choices=("cpu", "sm80", "sm90"), default=default,
                   help="build the native ORT op library for this target beside the output"
                   + (f" (default: {default})" if default else ""))
    _add_select(p)


def _add_select(p: argparse.ArgumentParser) -> None:
    p.add_argument("--select", choices=("measured", "all"),
                   help="measured: keep a fusion (and the fused model) only where it measured faster than ORT's "
                   "own kernels (default where the target's library runs here); all: keep every fusion")


def _run_demo(args: argparse.Namespace) -> int:
    from tkopt.models.export import export_example

    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tkopt-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / "example.onnx"
    exported = export_example(path)
    model = Path(exported) if isinstance(exported, str | Path) else path
    if not args.json:
        print(f"exported the example model to {model}")
    return _optimize_model(args, model, model.with_name(f"{model.stem}.tkopt.onnx"))


def _add_demo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="export the bundled example model, optimize it, show report and accuracy")
    p.add_argument("--workdir", help="where to write the models (default: a new temporary directory)")
    _add_common(p)
    _add_target(p, "cpu")
    p.set_defaults(run=_run_demo)


def _run_fetch_headers(args: argparse.Namespace) -> int:
    from tkopt.ort.headers import include_dir

    print(include_dir())
    return 0


def _add_fetch_headers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("fetch-headers", help="fetch ONNX Runtime's C API headers (npm) for building op libraries")
    p.set_defaults(run=_run_fetch_headers)


def _run_bench(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tkopt.bench import bench_onnx

    result = bench_onnx(args.model, target=args.target, runs=args.runs, warmup=args.warmup,
                        disable=args.disable, seed=args.seed, nodes=not args.no_nodes, select=args.select)
    result.render(Console())
    if args.json:
        print(f"wrote {result.write_json(args.json)}")
    return 0 if all(o.ok for o in result.outputs) else EXIT_ACCURACY


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="fused vs unfused: errors and latency, per output and per fused node")
    p.add_argument("model", help="input .onnx file")
    p.add_argument("--target", choices=("cpu", "sm80", "sm90"),
                   help="run the fused model on the native op library built for this target (without it: "
                   "fused ops run their torch references, accuracy only)")
    _add_select(p)
    p.add_argument("--disable", nargs="+", default=[], metavar="NAME", help="passes to skip")
    p.add_argument("--runs", type=int, default=20, help="timed runs per variant (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed runs first (default 3)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random inputs (default 0)")
    p.add_argument("--json", metavar="FILE", help="also write every number to FILE as JSON")
    p.add_argument("--no-nodes", action="store_true", help="skip the per-fused-node rows")
    p.add_argument("-v", "--verbose", action="store_true", help="show the traceback of an error")
    p.set_defaults(run=_run_bench)


def _run_coverage(args: argparse.Namespace) -> int:
    from tkopt.coverage import ENTRIES, markdown, run

    def progress(cell) -> None:  # noqa: ANN001 - tkopt.coverage.Cell, imported lazily
        state = "error" if cell.error else f"{cell.fusions} max rel {cell.max_rel:.1e}"
        print(f"{cell.model} · {ENTRIES[cell.entry]}: {state}", file=sys.stderr, flush=True)

    rows, cells = run(args.models, args.entries, progress)
    command = "tkopt coverage" + "".join(f" --{k} {' '.join(v)}" for k, v in
                                         (("models", args.models), ("entries", args.entries)) if v)
    text = markdown(rows, cells, command)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(text)
        tmp.replace(out)
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
    p.add_argument("-v", "--verbose", action="store_true", help="show the traceback of an error")
    p.set_defaults(run=_run_coverage)


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_optimize, _add_demo, _add_fetch_headers,
                                                                    _add_bench, _add_coverage]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tkopt", description="Graph-level fusion optimizer for ONNX and PyTorch")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ValueError, OSError, RuntimeError) as e:  # ModelLoadError is a ValueError
        if getattr(args, "verbose", False):
            raise
        from tkopt.ort.native import LibraryBuildError

        if isinstance(e, LibraryBuildError):  # the compiler's own message, lines intact
            print(f"tkopt: error: {e}", file=sys.stderr)
            return EXIT_ERROR
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"tkopt: error: {msg}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
