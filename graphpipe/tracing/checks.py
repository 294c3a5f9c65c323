"""Assertions inside forward: a check on values is not a shape.

Models check their inputs with assertions on tensor values. LLaVA checks that its image
tokens and its image features agree (`torch._check_tensor_all_with`), which torch.export
writes as a value read back to the host and scalar asserts on it:

    eq_1 = aten.eq(mul_4, 128)                # a bool tensor: the condition
    _is_all_true = aten._is_all_true(eq_1)    # a 0-dim bool tensor
    item = aten.item(_is_all_true)            # the value read back: u0
    sym_ite = sym_ite(item, 1, 0)
    _assert_scalar(sym_ite == 1, "...")       # nothing reaches the output

A read-back value (`item`, `_local_scalar_dense`) is what graphpipe refuses where it makes a
shape (no rank could size the messages after it), but here it makes none: every node after
it is scalar arithmetic that ends in an assertion. `drop_value_checks` finds such regions
(a read-back value whose every transitive user is a scalar op or an assertion) and

- keeps the check as `aten._assert_async(cond, msg)` on the condition tensor, where the
  region asserts exactly that the read-back boolean is true (the region is evaluated at
  True and at False to tell): the rank whose stage holds the condition checks it on every
  micro-batch, on the device, with no read-back to the host (torch's asynchronous assert);
- drops any other region (`torch._check(x.item() > 0)` on a number), with a warning that
  names the node and the assertions' messages: graphpipe does not evaluate it, the model's
  own eager forward still does.

A read-back value that reaches a tensor op (`torch.zeros(x.item())`) is a shape and is left
alone; `graphpipe.runtime.stage` refuses it by name.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import fx

from graphpipe.errors import TraceError

__all__ = ["ValueCheck", "drop_value_checks"]

_ops = torch.ops.aten
READS = frozenset({_ops.item.default, _ops._local_scalar_dense.default})
ASSERTS = frozenset(
    {
        _ops._assert_scalar.default,
        _ops._assert_async.default,
        _ops._assert_async.msg,
        _ops.sym_constrain_range.default,
        _ops.sym_constrain_range_for_size.default,
    }
)
# scalar functions a check computes on the read-back value: Python's (export writes
# operator.eq, operator.ge) and torch's sym_* (sym_ite, sym_not)
_SCALAR_MODULES = ("_operator", "math", "builtins")


class ValueCheck:
    """One check region found in a graph: its read-back node, the condition it reads, the
    assertions' messages and what became of it ("kept" or "dropped")."""

    def __init__(self, read: str, condition: str, messages: tuple[str, ...], fate: str) -> None:
        self.read, self.condition, self.messages, self.fate = read, condition, messages, fate

    def __repr__(self) -> str:
        return f"ValueCheck({self.read!r} on {self.condition!r}: {self.fate})"


def drop_value_checks(gm: fx.GraphModule, drop: bool = True) -> list[ValueCheck]:
    """Replace every value-check region of `gm` by a device-side assert, or drop it.

    Args:
        gm: An exported or fx graph; changed in place (linted and recompiled).
        drop: Whether a region that is not a yes-or-no on one boolean may be dropped. Not
            where the asserts may hold a decision torch.export took from the example's
            values (draft_export, static inputs): a region it cannot keep is refused.

    Returns:
        The regions found, in graph order.

    Warns:
        UserWarning: for each region dropped, naming its node and messages.

    Raises:
        TraceError: with `drop` False, a region that cannot be kept, naming it.

    Example:
        >>> class M(torch.nn.Module):
        ...     def forward(self, x):
        ...         torch._check_tensor_all(x > -100)  # a value check, not a shape
        ...         return x * 2
        >>> gm = torch.export.export(M(), (torch.ones(2),), strict=False).module()
        >>> [c.fate for c in drop_value_checks(gm)]
        ['kept']
    """
    found = []
    for read in [n for n in gm.graph.nodes if _is_read(n)]:
        region = _region(read)
        if region is None:
            continue  # the value makes a shape, or reaches the output
        found.append(_rewrite(gm.graph, read, region, drop))
    if found:
        gm.graph.lint()
        gm.recompile()
    return found


def is_check(read: fx.Node) -> bool:
    """Whether every use of `read` (a read-back) is scalar arithmetic ending in asserts: a
    check on values, which makes no shape."""
    return _region(read) is not None


def _is_read(node: fx.Node) -> bool:
    return (node.op == "call_function" and node.target in READS) or (
        node.op == "call_method" and node.target == "item"
    )


def _region(read: fx.Node) -> list[fx.Node] | None:
    """Every transitive user of `read`, in graph order, if all are scalar ops or asserts and
    at least one is an assert; else None."""
    seen: set[fx.Node] = set()
    stack = list(read.users)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        if not (_is_assert(node) or _is_scalar(node)):
            return None
        seen.add(node)
        stack.extend(node.users)
    if not any(_is_assert(n) for n in seen):
        return None
    return [n for n in read.graph.nodes if n in seen]


def _is_assert(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in ASSERTS


def _is_scalar(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False  # an aten op's module is torch._ops.aten: not scalar
    name = getattr(node.target, "__name__", "")
    module = getattr(node.target, "__module__", None) or ""
    return module in _SCALAR_MODULES or (module == "torch" and name.startswith("sym_"))


def _rewrite(graph: fx.Graph, read: fx.Node, region: list[fx.Node], drop: bool) -> ValueCheck:
    condition = read.args[0]  # the tensor read back (call_function and call_method alike)
    assert isinstance(condition, fx.Node)
    messages = tuple(_message(n) for n in region if _is_assert(n))
    text = "; ".join(m for m in messages if m) or f"the value check after {read.name}"
    kept = _is_bool(condition) and _asserts_true(read, region)
    if not kept and not drop:
        raise TraceError(
            f"node {read.name} reads {condition.name} back to the host and asserts {text}: "
            "traced with static inputs, this may be a decision torch.export took from the "
            "example's values, and it is not a yes-or-no on one boolean graphpipe can keep "
            "as a check; make the input it reads static too, or move it out of forward()"
        )
    if kept:
        failed = f"a check of the model's forward failed on {condition.name}: {text}"
        with graph.inserting_after(condition):
            check = graph.call_function(_ops._assert_async.msg, (condition, failed))
        check.meta["gp_module"] = read.meta.get("gp_module", "")
    for node in reversed(region):
        graph.erase_node(node)
    graph.erase_node(read)
    if not kept:
        warnings.warn(
            f"graphpipe.trace: dropped a check on a tensor's value (node {read.name} reads "
            f"{condition.name} back to the host; it asserts: {text}). It makes no shape, and "
            "graphpipe does not evaluate it on the pipeline's ranks; the model's own forward "
            "still does",
            stacklevel=4,
        )
    return ValueCheck(read.name, condition.name, messages, "kept" if kept else "dropped")


def _message(node: fx.Node) -> str:
    texts = [a for a in (*node.args[1:], *node.kwargs.values()) if isinstance(a, str)]
    return texts[0] if texts else ""


def _is_bool(node: fx.Node) -> bool:
    value = node.meta.get("val", node.meta.get("example_value"))
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool and value.numel() == 1


def _asserts_true(read: fx.Node, region: list[fx.Node]) -> bool:
    """Whether the region passes when `read` is True and fails when it is False."""
    return _passes(read, region, True) is True and _passes(read, region, False) is False


def _passes(read: fx.Node, region: list[fx.Node], value: bool) -> bool | None:
    """Evaluate the region with `read` = `value`: whether every assert holds (None where a
    node reads something outside the region, or a scalar op fails)."""
    env: dict[fx.Node, Any] = {read: value}
    ok = True
    for node in region:
        args = _resolved(node.args, env)
        kwargs = _resolved(node.kwargs, env)
        if args is None or kwargs is None:
            return None
        if _is_assert(node):
            if node.target is not _ops._assert_scalar.default:
                return None  # a range constraint or a tensor assert: not a yes or no
            ok = ok and bool(args[0])
            continue
        try:
            env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
        except Exception:
            return None
    return ok


def _resolved(tree: Any, env: dict[fx.Node, Any]) -> Any:
    missing = False

    def look(node: fx.Node) -> Any:
        nonlocal missing
        if node not in env:
            missing = True
            return None
        return env[node]

    out = fx.node.map_arg(tree, look)
    return None if missing else out
