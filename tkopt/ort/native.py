"""Build the native ORT custom-op library for one optimized model: TileLang source in, a .so out.

Each fused node's kernel program is lowered by TileLang for the target (its C backend for "cpu",
CUDA for "sm80"/"sm90"), wrapped with TileLang's own host launcher (`call(...)`, which on sm90 also
builds the TMA descriptors), renamed so many kernels can live in one library, and bound to the
node's ONNX inputs/outputs by a small generated C++ function. `csrc/op_library.h` is the shell
that registers the ops with ORT. No Python runs per op: the session calls straight into the .so.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import headers

CSRC = Path(__file__).with_name("csrc")
# sm80 also embeds compute_80 PTX: sm_80 machine code does not load on Hopper, and the brief runs the
# Ampere variant on an H200 too (the driver JIT-compiles the PTX there).
_GENCODE = {"sm80": "arch=compute_80,code=[sm_80,compute_80]", "sm90": "arch=compute_90a,code=sm_90a"}
ONNX_ELEM = {"float32": 1, "float16": 10, "bfloat16": 16, "float64": 11, "int64": 7, "int32": 6, "bool": 9}


class LibraryBuildError(RuntimeError):
    """Building the op library failed; the message carries the compiler's own output."""


@dataclass
class KernelSource:
    """One lowered kernel, renamed to `symbol`: its source, its params in `call` order, and the compiler flags its
    pass configs add (fast math: nvcc's, as TileLang builds the kernel for torch)."""

    symbol: str
    source: str
    params: list[tuple[str, str]]  # (name, "buffer" | "var" | "stream") in call order
    buffer_shapes: dict[str, list[int | str]]  # buffer name -> dims (ints static, str = symbolic var)
    has_init: bool
    flags: list[str] = field(default_factory=list)


def lower_program(func, arch: str, symbol: str, pass_configs: dict[str, bool] | None = None) -> KernelSource:
    """Lower a TileLang prim_func for `arch` with the program's `pass_configs` (ProgramSpec.pass_configs) and wrap
    it with TileLang's host launcher, renamed."""
    import tilelang
    import tvm
    from tilelang.jit.adapter.wrapper import TLWrapper
    from tvm.ir.transform import PassContext

    from tkopt.kernels.arch import target_of

    target = target_of(arch)
    configs = dict(pass_configs or {})
    with target, PassContext(config=configs):
        art = tilelang.lower(func, target=target)
    wrapper = TLWrapper(target)
    wrapper.assign_optimized_module(tvm.IRModule({func.attrs["global_symbol"]: func}))
    wrapper.assign_pass_configs(configs)
    wrapper.assign_host_module(art.host_mod)
    wrapper.assign_device_module(art.device_mod)
    code = wrapper.wrap(art.kernel_source)
    code = _rename(code, symbol)
    params, shapes = _signature(func)
    if arch != "cpu":
        params.append(("stream", "stream"))
    flags = ["--use_fast_math"] if arch != "cpu" and configs.get("tl.enable_fast_math") else []
    return KernelSource(symbol, code, params, shapes, has_init=arch != "cpu", flags=flags)


def _rename(code: str, symbol: str) -> str:
    """Give every exported or device symbol a per-kernel prefix (many kernels share one library)."""
    names = set(re.findall(r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?(\w+)", code))
    names |= set(re.findall(r"int32_t\s+(\w+_kernel)\s*\(", code))
    for name in sorted(names, key=len, reverse=True):
        code = re.sub(rf"\b{name}\b", f"{symbol}_{name}", code)
    # Only the wrapper's exported definitions: device code has members named init() too.
    code = re.sub(r"\b(int32_t|int|const char\*)(\s+)(call|init|get_last_error)\(", rf"\1\2{symbol}_\3(", code)
    return code


def _signature(func) -> tuple[list[tuple[str, str]], dict[str, list[int | str]]]:
    """Params of TileLang's `call`: every buffer in order, then each symbolic var once (first use)."""
    params: list[tuple[str, str]] = []
    shapes: dict[str, list[int | str]] = {}
    seen_vars: list[str] = []
    for p in func.params:
        buf = func.buffer_map.get(p)
        if buf is None:
            params.append((_text(p.name), "var"))
            continue
        dims: list[int | str] = []
        for d in buf.shape:
            if hasattr(d, "value"):
                dims.append(int(d.value))
            else:
                dims.append(_text(d))
                if _text(d) not in seen_vars:
                    seen_vars.append(_text(d))
        shapes[_text(buf.name)] = dims
        params.append((_text(buf.name), "buffer"))
    params += [(v, "var") for v in seen_vars]
    return params, shapes


def _text(x: object) -> str:
    """A plain str of a TVM name: TVM's own String (a str subclass) crashes when copied (deepcopy, asdict)."""
    return "".join(str(x))


@dataclass
class NodeBinding:
    """How one fused node's ONNX tensors feed its kernel.

    `buffers` maps each kernel buffer to ("in", i), ("out", j), or ("alias", other buffer) for a
    buffer the kernel's flags leave unread (it gets the other buffer's pointer). The ONNX tensor is
    viewed at the buffer's rank by merging leading dims, or by prepending 1s when it has fewer.
    `out_shapes[j]` is a C++ expression over s<i> (input i's shape, a std::vector<int64_t>) giving
    output j's shape. `var_exprs` gives a C++ value for a symbolic var that is no dim of an input.
    """

    node: str
    op: str
    dtype: str
    kernel: KernelSource
    buffers: dict[str, tuple[str, int | str]]
    out_shapes: dict[int, str]
    n_inputs: int
    var_exprs: dict[str, str] = field(default_factory=dict)


def _node_function(b: NodeBinding, index: int) -> str:
    k = b.kernel
    lines = [f"static void run_{index}(Ort::KernelContext& ctx, void* stream) {{",
             f'  static const std::string node = "{b.node}";', "  (void)stream;"]
    used_inputs = sorted({i for kind, i in b.buffers.values() if kind == "in"})
    for i in range(b.n_inputs):
        if i in used_inputs:
            lines.append(f"  auto in{i} = ctx.GetInput({i});")
            lines.append(f"  auto s{i} = tkopt::shape_of(in{i});")
    var_values: dict[str, str] = dict(b.var_exprs)
    # Shape checks: static dims must match exactly; symbolic dims are read from the first buffer using them.
    for name, (kind, i) in b.buffers.items():
        if kind != "in":
            continue
        dims = k.buffer_shapes[name]
        r = len(dims)
        lines.append(f"  auto v{i} = tkopt::view_as_rank(s{i}, {r});")
        for ax, d in enumerate(dims):
            if isinstance(d, int):
                lines.append(f'  tkopt::expect_dim(node, "{name}", v{i}, {ax}, {d});')
            elif d not in var_values:
                var_values[d] = f"v{i}[{ax}]"
            else:
                lines.append(f"  if (v{i}[{ax}] != {var_values[d]}) "
                             f"tkopt::fail(node, \"input {i} ({name}) axis {ax} does not match {d}\");")
    outs = sorted({i for kind, i in b.buffers.values() if kind == "out"})
    for j in outs:
        lines.append(f"  auto out{j} = ctx.GetOutput({j}, {b.out_shapes[j]});")
    for var, expr in var_values.items():
        lines.append(f"  int64_t {var} = {expr};")
        lines.append(f'  tkopt::expect_int32(node, "{var}", {var});')
    zero = " || ".join(f"{v} == 0" for v in var_values) or "false"
    lines.append(f"  if ({zero}) return;  // empty tensors: nothing to compute")
    args = []
    for name, kind in k.params:
        if kind == "stream":
            args.append("stream")
        elif kind == "var":
            args.append(f"(int32_t){name}")
        else:
            args.append(_pointer(b, name))
    call = f"{k.symbol}_call({', '.join(args)})"
    lines.append(f"  if ({call} != 0) tkopt::fail(node, {_error_expr(k)});")
    lines.append("}")
    return "\n".join(lines)


def _pointer(b: NodeBinding, name: str) -> str:
    io, i = b.buffers[name]
    if io == "alias":
        return _pointer(b, str(i))
    return f"(void*)in{i}.GetTensorRawData()" if io == "in" else f"out{i}.GetTensorMutableRawData()"


def _error_expr(k: KernelSource) -> str:
    return f'std::string("kernel {k.symbol} failed: ") + {k.symbol}_get_last_error()'


def _prototype(k: KernelSource) -> str:
    args = ", ".join("void*" if kind in ("buffer", "stream") else "int32_t" for _, kind in k.params)
    lines = [f'extern "C" int {k.symbol}_call({args});', f'extern "C" const char* {k.symbol}_get_last_error();']
    if k.has_init:
        lines.append(f'extern "C" int {k.symbol}_init();')
    return "\n".join(lines)


def generate_main_source(bindings: list[NodeBinding], kernels: list[KernelSource], target: str,
                         op_signatures: dict[tuple[str, str], tuple[list[bool], list[bool]]]) -> str:
    """The library's main C++ file: prototypes, one run function per node, the node and op tables."""
    cuda = target != "cpu"
    ep = '"CUDAExecutionProvider"' if cuda else '"CPUExecutionProvider"'
    parts = [f"#define TKOPT_EXECUTION_PROVIDER {ep}", f"#define TKOPT_CUDA {int(cuda)}",
             '#include "op_library.h"', ""]
    parts += [_prototype(k) for k in kernels]
    for k in kernels:
        if k.has_init:
            parts.append(f"static void init_{k.symbol}() {{ if ({k.symbol}_init() != 0) "
                         f'ORT_CXX_API_THROW(std::string("kernel init failed: ") + {k.symbol}_get_last_error(), '
                         "ORT_FAIL); }")
    parts += [_node_function(b, i) for i, b in enumerate(bindings)]
    table = ",\n".join(
        f'    {{"{b.node}", {{"{b.op}", run_{i}, {("init_" + b.kernel.symbol) if b.kernel.has_init else "nullptr"}}}}}'
        for i, b in enumerate(bindings)
    )
    parts.append("namespace tkopt {")
    parts.append("const std::unordered_map<std::string, NodeEntry>& node_table() {")
    parts.append(f"  static const std::unordered_map<std::string, NodeEntry> t = {{\n{table}\n  }};")
    parts.append("  return t;\n}")
    ops = ",\n".join(
        f'    FusedOp("{op}", {ONNX_ELEM[dt]}, {{{", ".join(map(_cbool, ins))}}}, {{{", ".join(map(_cbool, outs))}}})'
        for (op, dt), (ins, outs) in sorted(op_signatures.items())
    )
    parts.append("std::vector<FusedOp>& fused_ops() {")
    parts.append(f"  static std::vector<FusedOp> ops = {{\n{ops}\n  }};")
    parts.append("  return ops;\n}\n}  // namespace tkopt")
    return "\n".join(parts) + "\n"


def _cbool(b: bool) -> str:
    return "true" if b else "false"


def _compile_command(target: str) -> list[str]:
    """The compiler and the flags every source of a `target` library is compiled with."""
    import tilelang.env as tl_env

    includes = [f"-I{CSRC}", f"-I{tl_env.TILELANG_TEMPLATE_PATH}"]
    if target == "cpu":
        return [os.environ.get("CXX", "g++"), "-std=c++17", "-O3", "-fPIC", "-w", *includes]
    nvcc = shutil.which("nvcc") or "/usr/local/cuda/bin/nvcc"
    return [nvcc, "-std=c++20", "-O3", "-w", "-Xcudafe", "--diag_suppress=177", "--compiler-options", "-fPIC",
            "-gencode", _GENCODE[target], *includes, f"-I{tl_env.CUTLASS_INCLUDE_DIR}"]


@functools.cache
def _compiler_id(compiler: str) -> str:
    proc = subprocess.run([compiler, "--version"], capture_output=True, text=True)
    return proc.stdout.strip()


def _run(cmd: list[str], target: str, what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LibraryBuildError(f"building the tkopt op library for {target} failed: {what} ({cmd[0]} exit "
                                f"{proc.returncode}):\n" + (proc.stderr or proc.stdout)[-8000:])


def compile_object(kernel: KernelSource, target: str) -> Path:
    """One kernel's object file, compiled once per (source, compiler, flags) and kept in the tkopt cache,
    so the next library with this kernel, in any process, only links it."""
    from tkopt.cache import cache_path, digest, versions
    from tkopt.files import write_atomic

    cmd = [*_compile_command(target), *kernel.flags]
    obj = cache_path("ort-kernels", f"{digest(kernel.source, cmd[1:], _compiler_id(cmd[0]), versions())}.o")
    if obj.is_file():
        return obj
    ext = ".cc" if target == "cpu" else ".cu"
    with tempfile.TemporaryDirectory(prefix="tkopt-obj-") as tmp:
        src, out = Path(tmp) / f"{kernel.symbol}{ext}", Path(tmp) / f"{kernel.symbol}.o"
        src.write_text(kernel.source)
        _run([*cmd, "-c", str(src), "-o", str(out)], target, f"kernel {kernel.symbol}")
        write_atomic(obj, out.read_bytes())
    return obj


def compile_objects(kernels: list[KernelSource], target: str) -> dict[str, Path | LibraryBuildError]:
    """compile_object for every kernel, in parallel (compilers are subprocesses); symbol -> object, or the
    error that kernel's compile raised."""
    def one(k: KernelSource) -> Path | LibraryBuildError:
        try:
            return compile_object(k, target)
        except LibraryBuildError as e:
            return e

    workers = max(1, min(len(kernels), os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers, "tkopt-cc") as pool:
        return dict(zip((k.symbol for k in kernels), pool.map(one, kernels), strict=True))


def link_library(bindings: list[NodeBinding], kernels: list[KernelSource], objects: list[Path], target: str,
                 op_signatures: dict[tuple[str, str], tuple[list[bool], list[bool]]], out_path: Path) -> Path:
    """The library for `bindings`: its generated main source compiled and linked with the kernels'
    objects into `out_path`, atomically; LibraryBuildError carries the compiler output. Libraries are
    cached on disk by what they are built from (compiling ORT's C++ API header takes seconds)."""
    from tkopt.cache import cache_path, digest
    from tkopt.files import write_atomic

    out_path = Path(out_path)
    cmd = _compile_command(target)
    link = ["-shared"] if target == "cpu" else ["--shared", "-Xlinker", "--allow-multiple-definition"]
    include = headers.include_dir()
    source = generate_main_source(bindings, kernels, target, op_signatures)
    key = digest(source, [o.name for o in objects], cmd[1:], link, str(include), _compiler_id(cmd[0]))
    cached = cache_path("ort-kernels", f"{key}.so")
    if not cached.is_file():
        with tempfile.TemporaryDirectory(prefix="tkopt-lib-") as tmp:
            main = Path(tmp) / ("tkopt_ops.cc" if target == "cpu" else "tkopt_ops.cu")
            main.write_text(source)
            built = Path(tmp) / "lib.so"
            _run([*cmd, *link, f"-I{include}", str(main), *map(str, objects), "-o", str(built)], target, "linking")
            write_atomic(cached, built.read_bytes())
    write_atomic(out_path, cached.read_bytes())
    return out_path


def compile_library(bindings: list[NodeBinding], kernels: list[KernelSource], target: str,
                    op_signatures: dict[tuple[str, str], tuple[list[bool], list[bool]]], out_path: Path) -> Path:
    """Compile the kernels (in parallel, cached) and link them with the bindings into `out_path`."""
    objects = compile_objects(kernels, target)
    for obj in objects.values():
        if isinstance(obj, LibraryBuildError):
            raise obj
    return link_library(bindings, kernels, list(objects.values()), target, op_signatures, out_path)
