"""Torch backend: an IR graph imported from FX becomes an executable fx.GraphModule again.

The module is rebuilt from the GraphModule the graph was imported from: every unfused node is the
original fx.Node copied with its target, args and meta unchanged (only the nodes it reads are
remapped, following the IR if a pass rewired an input), fused nodes become calls to the tkopt::
custom ops (operator.getitem for multi-output ones), their derived inputs (FusedOp.derived_inputs) computed
once for all the nodes that share them, and the nodes a fusion replaced are gone.
What the IR does not hold (placeholders, get_attr, SymInt arithmetic, guards and assertions) is
copied from the original graph when first needed. Parameters and buffers stay module attributes
read by get_attr; the calling convention (pytree in/out specs of an unlifted ExportedProgram) is kept.
"""

from __future__ import annotations

import copy
import operator
from typing import Any

import numpy as np
import torch
from torch import fx
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.fx.proxy import GraphAppendingTracer

from tkopt.frontends.fx import node_val, slot_values
from tkopt.frontends.layout_copies import restride
from tkopt.fused_ops import schema
from tkopt.ir import Graph, Node, Value

from .torch_ops import CUSTOM_OPS, attr_args

_KEPT_ATTRS = ("_in_spec", "_out_spec", "range_constraints")  # what an unlifted program's code reads
_TORCH_DTYPES = {"bfloat16": torch.bfloat16}


class _Rebuilder:
    def __init__(self, graph: Graph) -> None:
        if graph.meta.get("source") != "fx" or "fx_module" not in graph.meta:
            raise ValueError(f"graph {graph.name!r} was not imported from FX (tkopt.frontends.fx.import_fx)")
        self.graph = graph
        self.old: fx.GraphModule = graph.meta["fx_module"]
        self.slots: dict[str, tuple[fx.Node | None, ...]] = graph.meta["fx_slots"]
        self.new = fx.Graph()
        self.new._codegen = copy.deepcopy(self.old.graph._codegen)
        self.env: dict[fx.Node, fx.Node] = {}  # original fx.Node -> its counterpart in the new graph
        self.vals: dict[int, fx.Node] = {}  # id(Value) -> new fx.Node
        self.derived: dict[tuple, fx.Node] = {}  # (function, the nodes it reads, its arguments) -> its node
        self.root: dict[str, Any] = {}
        self.consts = 0
        # fx nodes that were IR nodes or values at import: never re-copied behind the IR's back
        self.in_ir = {n.origin for n in self._all_imported()} | {
            v.origin for n in self._all_imported() for v in n.outputs if isinstance(v.origin, fx.Node)
        }

    def _all_imported(self) -> list[Node]:
        out = []
        for n in self.graph.nodes:
            out.extend(n.replaced if n.is_fused else [n])
        return [n for n in out if isinstance(n.origin, fx.Node)]

    # ---- original nodes the IR does not hold ----------------------------------------------------
    def copy_old(self, node: fx.Node) -> fx.Node | int:
        """The new counterpart of an original fx.Node outside the IR, copied on first use."""
        if node in self.env:
            return self.env[node]
        if node in self.in_ir:
            raise ValueError(f"fx node {node.name} was replaced in the IR but is still read by {list(node.users)}")
        if _reads_metadata_only(node) and any(a in self.in_ir and a not in self.env for a in node.all_input_nodes):
            self.env[node] = self._rederive(node)
            return self.env[node]
        if node.op == "get_attr":
            self.root[node.target] = operator.attrgetter(node.target)(self.old)
        elif node.op == "call_module":
            self.root[node.target] = self.old.get_submodule(node.target)
        self.env[node] = self.new.node_copy(node, self.copy_old)
        return self.env[node]

    def _rederive(self, node: fx.Node) -> fx.Node | int:
        """A size, stride or numel read off a tensor that no longer exists (a fusion absorbed it), read
        instead off a tensor that does and has the same symbolic value there: a graph input first, else
        any node emitted so far (the fused node's own output among them). A static value is the int."""
        val = node_val(node)
        known = val.node.maybe_as_int() if isinstance(val, torch.SymInt) else val
        if isinstance(known, int):
            return known
        expr = val.node.expr
        aten = torch.ops.aten
        olds = sorted(self.env, key=lambda n: n.op != "placeholder")
        for old in olds:
            t = node_val(old)
            if not isinstance(t, torch.Tensor) or isinstance(self.env[old], int):
                continue
            reads = [(aten.sym_size.int, (i,), d) for i, d in enumerate(t.shape)]
            reads += [(aten.sym_stride.int, (i,), d) for i, d in enumerate(t.stride())]
            reads.append((aten.sym_numel.default, (), t.numel()))
            for target, extra, d in reads:
                if isinstance(d, torch.SymInt) and d.node.expr == expr:
                    new = self.new.call_function(target, (self.env[old], *extra))
                    new.meta["val"] = val
                    return new
        raise ValueError(f"fx node {node.name} reads {expr} off a tensor a fusion removed, and no remaining tensor "
                         "has that size to read it from")

    def value(self, v: Value) -> fx.Node:
        if id(v) in self.vals:
            return self.vals[id(v)]
        origin = v.origin
        if isinstance(origin, fx.Node) and origin.op in ("placeholder", "get_attr"):
            return self.copy_old(origin)
        if v.const is not None:
            return self._new_const(v)
        raise ValueError(f"value {v.name} has no producer in graph {self.graph.name!r}")

    def _device_of(self, v: Value) -> torch.device:
        """Where a folded constant lives: where the value it replaces lived, else with the module's tensors."""
        val = v.origin.meta.get("val") if isinstance(v.origin, fx.Node) else None
        if isinstance(val, torch.Tensor):
            return val.device
        for t in (*self.root.values(), *self.old.parameters(), *self.old.buffers()):
            if isinstance(t, torch.Tensor):
                return t.device
        return torch.device("cpu")

    def _new_const(self, v: Value) -> fx.Node:
        """A constant a pass made (no original get_attr): registered as a buffer of the new module."""
        name = f"_tkopt_const_{self.consts}"
        self.consts += 1
        t = torch.from_numpy(np.array(v.const))
        t = t.to(_TORCH_DTYPES[v.dtype]) if v.dtype in _TORCH_DTYPES else t
        self.root[name] = t.to(self._device_of(v))
        self.vals[id(v)] = self.new.get_attr(name)
        return self.vals[id(v)]

    # ---- IR nodes -------------------------------------------------------------------------------
    def emit_original(self, node: Node) -> None:
        """The original fx node, reading the IR's inputs (None where a pass left one out: `slot_values`)."""
        origin: fx.Node = node.origin
        subst = {f: None if v is None else self.value(v) for f, v in slot_values(node, self.slots).items()}
        new = self.new.node_copy(origin, lambda a: subst[a] if a in subst else self.copy_old(a))
        self.env[origin] = new
        if len(node.outputs) == 1 and node.outputs[0].origin is origin:
            self.vals[id(node.outputs[0])] = new
            return
        for v in node.outputs:  # multi-output: each output is one of the original getitem nodes
            sel = v.origin
            if isinstance(sel, fx.Node):
                self.env[sel] = self.vals[id(v)] = self.new.node_copy(sel, lambda a: self.env[a])

    def emit_fused(self, node: Node) -> None:
        if node.op not in CUSTOM_OPS:
            raise ValueError(f"fused node {node.name}: no torch custom op for {node.op!r}")
        d = schema(node.op)
        ins = self._derived(node, d.padded([None if v is None else self.value(v) for v in node.inputs]))
        call = self.new.call_function(CUSTOM_OPS[node.op], (*ins, *attr_args(node.op, node.attrs)))
        multi = len(d.outputs) > 1
        for i, v in enumerate(node.outputs):
            out = self.new.call_function(operator.getitem, (call, i)) if multi else call
            if isinstance(v.origin, fx.Node):
                val = node_val(v.origin)
                if val is not None:
                    out.meta["val"] = val
                    out = self._restride(out, val)
                self.env[v.origin] = out  # SymInt nodes copied later may read it (sym_size)
            self.vals[id(v)] = out

    def _derived(self, node: Node, ins: list[fx.Node | None]) -> list[fx.Node | None]:
        """`ins` (the fused node's inputs in the new graph) with the op's derived inputs filled in where they
        apply (FusedOp.derived_inputs): each derivation emitted once, for every node that has the same one."""
        d = schema(node.op)
        vals = [None if a is None else node_val(a) for a in ins]
        for name, derive in d.derived_inputs.items():
            i = d.inputs.index(name)
            how = None if ins[i] is not None else derive(vals, d.full_attrs(node.attrs))
            if how is None:
                continue
            fn, reads, args = how
            key = (fn, tuple(ins[j] for j in reads), args)
            if key not in self.derived:  # its aten ops, traced onto the new graph
                tracer = GraphAppendingTracer(self.new)
                out = fn(*[fx.Proxy(ins[j], tracer) for j in reads], *args).node
                out.meta["val"] = fn(*[vals[j] for j in reads], *args)
                self.derived[key] = out
            ins[i] = self.derived[key]
        return ins

    def _restride(self, out: fx.Node, val: torch.Tensor) -> fx.Node:
        """Give a custom op's (contiguous) result the memory order the replaced node's result had.

        Decomposed graphs rely on it: a reshape traced as aten.view over SDPA's bshd-ordered output
        only works on that order. Dense layouts are rebuilt as permute -> contiguous -> permute back.
        """
        if val.is_contiguous() or not is_non_overlapping_and_dense_or_false(val):
            return out
        return restride(self.new, out, val)

    def emit(self, node: Node) -> None:
        if node.is_fused:
            self.emit_fused(node)
        elif isinstance(node.origin, fx.Node):
            self.emit_original(node)
        else:
            raise ValueError(
                f"node {node.name} ({node.op}) has no fx origin and is not fused; the torch backend only "
                "re-emits original nodes (stand-ins must be expanded by the finalize pass)"
            )

    # ---- whole graph ----------------------------------------------------------------------------
    def build(self) -> fx.GraphModule:
        old_nodes = list(self.old.graph.nodes)
        for n in old_nodes:
            if n.op == "placeholder":
                self.copy_old(n)
        effects = [n for n in old_nodes if n not in self.in_ir and n.op != "output" and not n.users and n.is_impure()]
        early = [n for n in effects if not self._reads_ir(n)]
        for n in early:  # input guards first, so bad inputs fail before any compute
            self.copy_old(n)
        for node in self.graph.nodes:
            self.emit(node)
        for n in effects:  # an assertion about a tensor a fusion removed is dropped with it
            if self._copyable(n):
                self.copy_old(n)
        self._output(self.old.graph.find_nodes(op="output")[0])
        self.new.lint()
        gm = fx.GraphModule(self.root, self.new, class_name="TkoptModule")
        for attr in _KEPT_ATTRS:
            if attr in self.old.__dict__:
                setattr(gm, attr, self.old.__dict__[attr])
        gm.recompile()
        return gm

    def _copyable(self, node: fx.Node) -> bool:
        return all(
            a in self.env or (a not in self.in_ir and self._copyable(a)) for a in node.all_input_nodes
        )

    def _reads_ir(self, node: fx.Node) -> bool:
        seen: set[fx.Node] = set()
        stack = list(node.all_input_nodes)
        while stack:
            n = stack.pop()
            if n in self.in_ir:
                return True
            if n not in seen:
                seen.add(n)
                stack.extend(n.all_input_nodes)
        return False

    def _output(self, old_out: fx.Node) -> None:
        outs = iter(self.graph.outputs)
        is_ir = iter(self.graph.meta["fx_output_is_ir"])

        def leaf(a: fx.Node) -> fx.Node:
            return self.value(next(outs)) if next(is_ir) else self.copy_old(a)

        out = self.new.output(fx.node.map_arg(old_out.args[0], leaf), old_out.type)
        out.meta = copy.copy(old_out.meta)


_METADATA_OPS = {torch.ops.aten.sym_size.int, torch.ops.aten.sym_stride.int, torch.ops.aten.sym_numel.default,
                 torch.ops.aten.sym_storage_offset.default}


def _reads_metadata_only(node: fx.Node) -> bool:
    """A node whose result is a size-like number (SymInt) read off its tensor input, not its data:
    aten.sym_size/sym_stride/sym_numel and the size()/stride()/numel()/dim() methods."""
    if node.op == "call_method":
        return node.target in ("size", "stride", "numel", "dim") and isinstance(node_val(node), (int, torch.SymInt))
    return node.op == "call_function" and node.target in _METADATA_OPS


def to_torch_module(graph: Graph) -> fx.GraphModule:
    """Rebuild an executable GraphModule from an IR graph imported by `import_fx` (after passes)."""
    return _Rebuilder(graph).build()
