"""FX frontend: a torch.export ExportedProgram or an fx.GraphModule (as a torch.compile backend gets
it) becomes a tkopt IR Graph with canonical ops.

The IR holds the tensor dataflow only. Symbolic-size arithmetic (aten.sym_size, operator.mul on
SymInts), guards and assertions stay in the FX graph: the torch backend re-emits them from there, and
attributes that depend on them (a Reshape's target shape) spell the size as a string ("s0*s1").
Every IR node keeps its fx.Node as `origin` and every Value the fx.Node that produces it; the outputs
of a multi-output node (native_layer_norm, split, ...) are its operator.getitem users, so each IR
value maps to exactly one fx.Node. `graph.meta` keeps what the backend needs to rebuild:
"fx_module" (the GraphModule imported; for an ExportedProgram its unlifted `module()`, with
parameters, buffers and lifted constants as get_attr), "fx_slots" (IR node name -> the fx.Node each
input slot came from, None for scalar constants) and "fx_output_is_ir" (per output leaf).
Parameters and persistent buffers get no `const` (`_mutable_state`): they may change after compiling.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch import fx, nn
from torch.fx.experimental.symbolic_shapes import statically_known_true, sym_eq

from tkopt.frontends.layout_copies import drop_layout_copies
from tkopt.ir import Graph, Node, Value

log = logging.getLogger(__name__)
INT64_MAX = 2**63 - 1
_DTYPES = {
    torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float64: "float64",
    torch.int64: "int64", torch.int32: "int32", torch.bool: "bool", torch.int8: "int8", torch.uint8: "uint8",
}
_NP_DTYPES = {"bfloat16": np.float32}  # numpy has no bfloat16: such constants are kept as float32


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPES.get(dtype, str(dtype).removeprefix("torch."))


def node_val(node: fx.Node) -> Any:
    """The example value FX recorded for a node (FakeTensor, SymInt, tuple, ...), or None."""
    return node.meta.get("val", node.meta.get("example_value"))


def slot_values(node: Node, slots: dict[str, tuple[fx.Node | None, ...]]) -> dict[fx.Node, Value | None]:
    """Each fx.Node argument of `node`'s origin (`slots`: the graph's "fx_slots") with the IR value now in its
    slot; None where a pass left that input out (an SDPA mask that keeps every score), so it reads as None."""
    return {f: v for f, v in zip(slots.get(node.name, ()), node.inputs, strict=False) if f is not None}


def _dim(d: Any) -> int | str:
    if isinstance(d, torch.SymInt):
        known = d.node.maybe_as_int()  # specialised since the value was recorded
        return str(d) if known is None else known  # the expression, e.g. "s0" or "2*s0"
    return d


def _is_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor)


def _is_multi(val: Any) -> bool:
    return isinstance(val, (tuple, list)) and any(_is_tensor(t) for t in val)


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.cpu().numpy()


def _attr_value(x: Any) -> Any:
    """Plain Python for an attribute: SymInt args as their expression string, dtypes as names."""
    if isinstance(x, fx.Node):
        v = node_val(x)
        return _dim(v) if v is not None else x.name
    if isinstance(x, (list, tuple)):
        return [_attr_value(e) for e in x]
    if isinstance(x, torch.dtype):
        return dtype_name(x)
    if isinstance(x, (torch.device, torch.memory_format, torch.layout)):
        return str(x)
    if isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return str(x)
    return x


class Scalar:
    """A Python number in a tensor operand slot (aten.mul.Tensor(x, 2.0)); becomes a const Value."""

    def __init__(self, value: Any) -> None:
        self.value = value


Operand = fx.Node | Scalar | None
Mapped = tuple[str, list[Operand], dict[str, Any]]
Handler = Callable[[fx.Node, dict[str, Any]], "Mapped | None"]


def _operand(x: Any) -> Operand:
    return x if isinstance(x, fx.Node) or x is None else Scalar(x)


def _rank(node: fx.Node) -> int:
    return node_val(node).dim()


def _axis(dim: int, rank: int) -> int:
    return dim + rank if dim < 0 else dim


# ---- aten op -> canonical op handlers (None: leave the node unmapped) -------------------------------
def _unary(op: str) -> Handler:
    return lambda n, a: (op, [a["self"]], {})


def _binary(op: str, first: str = "self", second: str = "other") -> Handler:
    def h(n: fx.Node, a: dict[str, Any]) -> Mapped | None:
        if a.get("alpha", 1) != 1 or a.get("rounding_mode") is not None:
            return None
        return op, [_operand(a[first]), _operand(a[second])], {}

    return h


def _where(n: fx.Node, a: dict[str, Any]) -> Mapped:
    return "Where", [a["condition"], _operand(a["self"]), _operand(a["other"])], {}


def _linear(n: fx.Node, a: dict[str, Any]) -> Mapped:
    return "Linear", [a["input"], a["weight"], a.get("bias")], {}


def _addmm(n: fx.Node, a: dict[str, Any]) -> Mapped:
    attrs = {"transA": 0, "transB": 0, "alpha": float(a.get("alpha", 1)), "beta": float(a.get("beta", 1))}
    return "Gemm", [a["mat1"], a["mat2"], a["self"]], attrs


def _matmul(second: str) -> Handler:
    return lambda n, a: ("MatMul", [a["self"], a[second]], {})


def _t(n: fx.Node, a: dict[str, Any]) -> Mapped:
    return "Transpose", [a["self"]], {"perm": [1, 0] if _rank(n) == 2 else list(range(_rank(n)))}


def _transpose(n: fx.Node, a: dict[str, Any]) -> Mapped:
    r = _rank(n)
    perm = list(range(r))
    d0, d1 = _axis(a["dim0"], r), _axis(a["dim1"], r)
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return "Transpose", [a["self"]], {"perm": perm}


def _permute(n: fx.Node, a: dict[str, Any]) -> Mapped:
    return "Transpose", [a["self"]], {"perm": [_axis(d, _rank(n)) for d in a["dims"]]}


def _reshape(n: fx.Node, a: dict[str, Any]) -> Mapped | None:
    shape = a.get("size", a.get("shape"))
    if shape is None:  # view.dtype
        return None
    return "Reshape", [a["self"]], {"shape": _attr_value(list(shape))}


def _same_dtype(n: fx.Node, dtype: torch.dtype | None) -> bool:
    """An op's optional `dtype=` argument is a no-op when it is the input's own dtype."""
    return dtype is None or dtype == node_val(n.args[0]).dtype


def _softmax(n: fx.Node, a: dict[str, Any]) -> Mapped | None:
    """softmax(x, dim, dtype=float32) / _softmax(x, dim, half_to_float=True) of a half or bfloat16 x
    (HF attention) computes and returns float32: Softmax with attribute dtype "float32" says so.
    Other dtype changes stay unmapped."""
    src, out = node_val(n.args[0]).dtype, node_val(n).dtype
    if out == src:
        return "Softmax", [a["self"]], {"axis": a["dim"]}
    if src in (torch.float16, torch.bfloat16) and out == torch.float32:
        return "Softmax", [a["self"]], {"axis": a["dim"], "dtype": "float32"}
    return None


def _layer_norm(n: fx.Node, a: dict[str, Any]) -> Mapped:
    attrs = {"axis": -len(a["normalized_shape"]), "epsilon": float(a["eps"])}
    return "LayerNormalization", [a["input"], a.get("weight"), a.get("bias")], attrs


def _rms_norm(n: fx.Node, a: dict[str, Any]) -> Mapped:
    """aten.rms_norm; eps=None is the input dtype's machine epsilon, as F.rms_norm documents."""
    eps = a.get("eps")
    if eps is None:
        eps = torch.finfo(node_val(n.args[0]).dtype).eps
    attrs = {"axis": -len(a["normalized_shape"]), "epsilon": float(eps)}
    return "RMSNormalization", [a["input"], a.get("weight")], attrs


def _gelu(n: fx.Node, a: dict[str, Any]) -> Mapped:
    return "Gelu", [a["self"]], {"approximate": a.get("approximate", "none")}


def _reduce(op: str) -> Handler:
    def h(n: fx.Node, a: dict[str, Any]) -> Mapped | None:
        if not _same_dtype(n, a.get("dtype")):
            return None
        src = n.args[0]
        dims = a.get("dim")
        axes = [_axis(d, _rank(src)) for d in dims] if dims else list(range(_rank(src)))
        return op, [a["self"]], {"axes": axes, "keepdims": int(bool(a.get("keepdim", False)))}

    return h


def _cast(n: fx.Node, a: dict[str, Any]) -> Mapped | None:
    src = node_val(n.args[0])
    dev = a.get("device")
    if a.get("dtype") is None or (dev is not None and torch.device(dev) != src.device):
        return None
    if a.get("layout") not in (None, torch.strided) or a.get("memory_format") not in (None, torch.preserve_format):
        return None
    return "Cast", [a["self"]], {"to": dtype_name(a["dtype"])}


def _type_as(n: fx.Node, a: dict[str, Any]) -> Mapped | None:
    """x.type_as(y): x cast to y's dtype, where both are on one device (type_as moves to y's device too)."""
    src, like = node_val(n.args[0]), node_val(n.args[1])
    if not (_is_tensor(src) and _is_tensor(like)) or src.device != like.device:
        return None
    return "Cast", [a["self"]], {"to": dtype_name(like.dtype)}


def _identity(n: fx.Node, a: dict[str, Any]) -> Mapped | None:
    """clone/contiguous/alias/detach are Identity only when the result keeps the input's strides:
    a clone that makes a tensor contiguous is what a later aten.view relies on, so it stays."""
    src, out = node_val(n.args[0]), node_val(n)
    if src.dim() != out.dim() or not statically_known_true(sym_eq(tuple(src.stride()), tuple(out.stride()))):
        return None
    return "Identity", [a["self"]], {}


def _sdpa(mask_arg: str | None) -> Handler:
    """aten.scaled_dot_product_attention and the backend variants Dynamo/AOT graphs hold."""

    def h(n: fx.Node, a: dict[str, Any]) -> Mapped | None:
        if a.get("dropout_p", 0.0) != 0.0:
            return None
        attrs = {
            "scale": float(a.get("scale") or 0.0), "is_causal": int(bool(a.get("is_causal", False))),
            "enable_gqa": int(bool(a.get("enable_gqa", False))),
        }
        mask = a.get(mask_arg) if mask_arg else None
        return "ScaledDotProductAttention", [a["query"], a["key"], a["value"], mask], attrs

    return h


def _expand(n: fx.Node, a: dict[str, Any]) -> Mapped:
    return "Expand", [a["self"]], {"shape": _attr_value(list(a["size"]))}


def _unsqueeze(n: fx.Node, a: dict[str, Any]) -> Mapped:
    return "Unsqueeze", [a["self"]], {"axes": [_axis(a["dim"], _rank(n))]}


def _squeeze(n: fx.Node, a: dict[str, Any]) -> Mapped:
    dim = a.get("dim")
    if dim is None:
        return "Squeeze", [a["self"]], {}
    r = _rank(n.args[0])
    return "Squeeze", [a["self"]], {"axes": [_axis(d, r) for d in (dim if isinstance(dim, (list, tuple)) else [dim])]}


def _slice(n: fx.Node, a: dict[str, Any]) -> Mapped:
    start, end = a.get("start"), a.get("end")
    attrs = {
        "starts": [_attr_value(0 if start is None else start)],
        "ends": [_attr_value(INT64_MAX if end is None else end)],
        "axes": [_axis(a.get("dim", 0), _rank(n))], "steps": [a.get("step", 1)],
    }
    return "Slice", [a["self"]], attrs


def _cat(n: fx.Node, a: dict[str, Any]) -> Mapped:
    return "Concat", list(a["tensors"]), {"axis": _axis(a.get("dim", 0), _rank(n))}


def _split(n: fx.Node, a: dict[str, Any]) -> Mapped:
    axis = _axis(a.get("dim", 0), _rank(n.args[0]))
    return "Split", [a["self"]], {"axis": axis, "split": [_dim(t.shape[axis]) for t in node_val(n)]}


def _trilu(upper: int) -> Handler:
    return lambda n, a: ("Trilu", [a["self"]], {"upper": upper, "k": a.get("diagonal", 0)})


def _index_select(n: fx.Node, a: dict[str, Any]) -> Mapped:
    return "Gather", [a["self"], a["index"]], {"axis": _axis(a["dim"], _rank(n))}


HANDLERS: dict[str, Handler] = {
    "add": _binary("Add"), "sub": _binary("Sub"), "mul": _binary("Mul"), "div": _binary("Div"),
    "pow": _binary("Pow", "self", "exponent"), "maximum": _binary("Max"), "minimum": _binary("Min"),
    "eq": _binary("Equal"), "lt": _binary("Less"), "gt": _binary("Greater"), "logical_and": _binary("And"),
    "where": _where,
    **{k: _unary(v) for k, v in {
        "sqrt": "Sqrt", "rsqrt": "Rsqrt", "reciprocal": "Reciprocal", "exp": "Exp", "erf": "Erf", "tanh": "Tanh",
        "sigmoid": "Sigmoid", "relu": "Relu", "neg": "Neg", "logical_not": "Not", "silu": "Silu",
    }.items()},
    "linear": _linear, "addmm": _addmm, "mm": _matmul("mat2"), "bmm": _matmul("mat2"), "matmul": _matmul("other"),
    "t": _t, "transpose": _transpose, "permute": _permute,
    "view": _reshape, "reshape": _reshape, "_unsafe_view": _reshape,
    "softmax": _softmax, "_softmax": _softmax,
    "layer_norm": _layer_norm, "native_layer_norm": _layer_norm, "rms_norm": _rms_norm, "gelu": _gelu,
    "mean": _reduce("ReduceMean"), "sum": _reduce("ReduceSum"),
    "_to_copy": _cast, "to": _cast, "type_as": _type_as,
    "clone": _identity, "alias": _identity, "detach": _identity, "contiguous": _identity,
    "lift_fresh_copy": _identity,
    "scaled_dot_product_attention": _sdpa("attn_mask"),
    "_scaled_dot_product_flash_attention_for_cpu": _sdpa("attn_mask"),
    "_scaled_dot_product_flash_attention": _sdpa(None),
    "_scaled_dot_product_efficient_attention": _sdpa("attn_bias"),
    "_scaled_dot_product_cudnn_attention": _sdpa("attn_bias"),
    "expand": _expand, "unsqueeze": _unsqueeze, "squeeze": _squeeze, "slice": _slice, "cat": _cat,
    "split": _split, "split_with_sizes": _split, "tril": _trilu(0), "triu": _trilu(1),
    "index_select": _index_select,
}


def _unobserved_in_place(node: fx.Node) -> str | None:
    """The out-of-place name of an in-place op (add_ -> add) whose mutated input nothing else reads.

    Decompositions run below functionalization write such ops (rms_norm's `mean(...).add_(eps)` in
    make_fx and AOTAutograd graphs): the mutation is unobservable, so the op is its functional form.
    A mutated graph input, constant or value read elsewhere stays unmapped.
    """
    name = node.target.overloadpacket.__name__
    target = _mutated_intermediate(node)
    if name.startswith("_") or target is None or len(target.users) != 1:
        return None
    return name[:-1]


def _mutated_intermediate(node: fx.Node) -> fx.Node | None:
    """The intermediate (a call_function's result) that `node`, an in-place aten op, writes; None for any other
    node, or where what it writes is a graph input, parameter or buffer."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    schema = node.target._schema
    if not (schema.name.endswith("_") and schema.arguments and schema.arguments[0].is_write):
        return None
    target = node.args[0] if node.args else None
    return target if isinstance(target, fx.Node) and target.op == "call_function" else None


def functional(ep: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """`ep`, functionalized by torch where its graph mutates an intermediate that something else reads too.

    torch.export's graph keeps in-place ops. XLM and FlauBERT write `scores.masked_fill_(mask, -inf)` and then read
    `scores` again: the mask reaches softmax only through the mutation, which the IR's dataflow does not carry, so
    the op stays opaque (`_unobserved_in_place` maps only mutations nothing else reads) and the attention there
    unfused. torch's own functionalization (run_decompositions with an empty table: no op is decomposed) makes the
    mutation dataflow, aliasing views included; it re-traces the program (0.6 s for a 2-layer XLM on CPU), so only
    graphs that need it pay. Mutated inputs and buffers are left as they are: the unlifted module writes them back.
    """
    if not any(len(target.users) > 1 for n in ep.graph.nodes if (target := _mutated_intermediate(n)) is not None):
        return ep
    try:
        return ep.run_decompositions({})
    except Exception as e:  # noqa: BLE001 - the mutation then stays an opaque op, as before
        log.info("tkopt: functionalizing the export failed (%s: %s); its in-place ops stay opaque",
                 type(e).__name__, e)
        return ep


def bind_args(target: torch._ops.OpOverload, node: fx.Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in."""
    out: dict[str, Any] = {}
    for i, arg in enumerate(target._schema.arguments):
        if i < len(node.args) and not arg.kwarg_only:
            out[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            out[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


def op_name(node: fx.Node) -> str:
    """The namespaced name an unmapped node keeps: "aten::gather", "operator::getitem", "method::view"."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return t._schema.name
    if node.op == "call_method":
        return f"method::{t}"
    if node.op == "call_module":
        return f"module::{t}"
    module = getattr(t, "__module__", None) or ""
    root = "operator" if module in ("_operator", "operator") else module.split(".")[0] or "python"
    return f"{root}::{getattr(t, '__name__', str(t))}"


class FxImporter:
    """One import: walks the FX graph in order and builds the IR graph."""

    def __init__(self, gm: fx.GraphModule, name: str) -> None:
        self.gm = gm
        self.graph = Graph(name)
        self.values: dict[fx.Node, Value] = {}
        self.slots: dict[str, tuple[fx.Node | None, ...]] = {}
        for n in gm.graph.nodes:
            self.graph.reserve(n.name)

    def run(self) -> Graph:
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                self._placeholder(node)
            elif node.op == "get_attr":
                self._get_attr(node)
            elif node.op == "output":
                self._output(node)
            elif self._is_selector(node):
                continue  # getitem on a multi-output node: its Value was made with the producer
            else:
                self._call(node)
        g = self.graph
        g.meta.update(source="fx", fx_module=self.gm, fx_slots=self.slots)
        return g

    # ---- leaves ---------------------------------------------------------------------------------
    def _tensor_value(self, node: fx.Node, val: Any, name: str | None = None) -> Value:
        v = Value(name or node.name, dtype_name(val.dtype), tuple(_dim(d) for d in val.shape), origin=node)
        self.values[node] = v
        return v

    def _placeholder(self, node: fx.Node) -> None:
        val = node_val(node)
        if _is_tensor(val):
            self.graph.inputs.append(self._tensor_value(node, val))

    def _get_attr(self, node: fx.Node) -> None:
        obj = operator.attrgetter(node.target)(self.gm)
        if isinstance(obj, torch.Tensor):
            v = self._tensor_value(node, obj)
            if not _mutable_state(self.gm, node.target, obj):
                v.const = _to_numpy(obj)

    def _output(self, node: fx.Node) -> None:
        leaves: list[fx.Node] = []
        fx.node.map_arg(node.args, leaves.append)
        self.graph.outputs = [self.values[x] for x in leaves if x in self.values]
        self.graph.meta["fx_output_is_ir"] = [x in self.values for x in leaves]

    def _is_selector(self, node: fx.Node) -> bool:
        return (
            node.target is operator.getitem and isinstance(node.args[0], fx.Node)
            and _is_multi(node_val(node.args[0])) and isinstance(node.args[1], int)
        )

    # ---- ops ------------------------------------------------------------------------------------
    def _call(self, node: fx.Node) -> None:
        val = node_val(node)
        if not (_is_tensor(val) or _is_multi(val)):
            return  # SymInt arithmetic, guards, assertions: stay FX-only
        mapped = None
        if isinstance(node.target, torch._ops.OpOverload) and node.target.namespace in ("aten", "tkopt"):
            name = _unobserved_in_place(node) or node.target.overloadpacket.__name__
            handler = HANDLERS.get(name)
            if handler is not None:
                mapped = handler(node, bind_args(node.target, node))
        if mapped is not None and any(isinstance(x, fx.Node) and x not in self.values for x in mapped[1]):
            mapped = None  # a SymInt in a tensor slot (x * sym_size): keep the aten op as is
        if mapped is None:
            mapped = self._unmapped(node)
        op, operands, attrs = mapped
        inputs: list[Value | None] = []
        slots: list[fx.Node | None] = []
        like = next((self.values[x] for x in operands if isinstance(x, fx.Node)), None)
        for x in operands:
            if isinstance(x, Scalar):
                inputs.append(self._scalar(x.value, like, val))
                slots.append(None)
            else:
                inputs.append(None if x is None else self.values[x])
                slots.append(x)
        outputs = self._outputs(node, val)
        self.graph.add_node(Node(op, inputs, outputs, attrs, name=node.name, origin=node))
        self.slots[node.name] = tuple(slots)

    def _outputs(self, node: fx.Node, val: Any) -> list[Value]:
        if _is_tensor(val):
            return [self._tensor_value(node, val)]
        picks = {u.args[1]: u for u in node.users if self._is_selector(u)}
        outs = []
        for i, t in enumerate(val):
            sel = picks.get(i)
            if sel is not None and _is_tensor(t):
                outs.append(self._tensor_value(sel, t))
            elif _is_tensor(t):
                outs.append(Value(self.graph.fresh_name(f"{node.name}_out{i}"), dtype_name(t.dtype),
                                  tuple(_dim(d) for d in t.shape)))
            else:
                outs.append(Value(self.graph.fresh_name(f"{node.name}_out{i}")))
        for u in node.users:  # a second getitem of the same index reads the same Value
            if self._is_selector(u) and u not in self.values:
                self.values[u] = outs[u.args[1]]
        return outs

    def _unmapped(self, node: fx.Node) -> Mapped:
        operands: list[Operand] = []
        fx.node.map_arg((node.args, node.kwargs), lambda x: operands.append(x) if x in self.values else None)
        attrs: dict[str, Any] = {}
        if isinstance(node.target, torch._ops.OpOverload):
            for k, v in bind_args(node.target, node).items():
                if not _holds_tensor(v, self.values):
                    attrs[k] = _attr_value(v)
        return op_name(node), operands, attrs

    def _scalar(self, x: Any, like: Value | None, out_val: Any) -> Value:
        dtype = like.dtype if like is not None else None
        if dtype is None or (isinstance(x, float) and not dtype.startswith(("float", "bfloat"))):
            dtype = dtype_name(out_val.dtype)
        data = np.array(x, dtype=_NP_DTYPES.get(dtype, dtype))
        v = Value(self.graph.fresh_name("scalar"), dtype, (), const=data)
        return v


def _mutable_state(gm: fx.GraphModule, target: str, obj: torch.Tensor) -> bool:
    """Whether a get_attr reads state the user may change after compiling: a parameter (trained, loaded)
    or a persistent buffer (loaded with the state dict, running statistics). Such values are graph
    inputs to the passes, never constants to fold or decide on: a folded `1 + weight` would keep the
    compile-time weight and take no gradient. Non-persistent buffers (masks, rotary frequencies)
    and lifted constants are derived at construction and stay constants."""
    if isinstance(obj, nn.Parameter):
        return True
    owner_name, _, name = target.rpartition(".")
    owner = gm.get_submodule(owner_name) if owner_name else gm
    return name in owner._buffers and name not in owner._non_persistent_buffers_set


def _holds_tensor(x: Any, values: dict[fx.Node, Value]) -> bool:
    found: list[bool] = []
    fx.node.map_arg(x, lambda n: found.append(n in values))
    return any(found)


def _ensure_meta(gm: fx.GraphModule, example_inputs: Sequence[Any] | None) -> None:
    """A GraphModule without recorded example values (symbolic_trace) gets them by fake propagation."""
    placeholders = gm.graph.find_nodes(op="placeholder")
    if all(node_val(p) is not None for p in placeholders):
        return
    if example_inputs is None:
        raise ValueError(
            "fx GraphModule has placeholders without meta['val'] / meta['example_value']; "
            "pass example_inputs so shapes can be propagated"
        )
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(*example_inputs)


def import_fx(
    model: torch.export.ExportedProgram | fx.GraphModule, example_inputs: Sequence[Any] | None = None
) -> Graph:
    """Import an ExportedProgram (before or after run_decompositions) or an fx.GraphModule."""
    if isinstance(model, torch.export.ExportedProgram):
        model = functional(model)
        gm = model.module()  # unlifted: parameters, buffers and lifted constants are get_attr
        drop_layout_copies(gm)  # torch's slow paths' copies before attention (a copy of the program: ours to edit)
        graph = FxImporter(gm, "exported_program").run()
        graph.meta["exported_program"] = model
        return graph
    if not isinstance(model, fx.GraphModule):
        raise TypeError(f"import_fx takes an ExportedProgram or fx.GraphModule, got {type(model).__name__}")
    _ensure_meta(model, example_inputs)
    return FxImporter(model, type(model).__name__).run()
