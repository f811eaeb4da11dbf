"""A stage's backward in two parts, for zero-bubble schedules: B, the input gradient (what the previous stage
waits for), now; W, the parameter gradients (what nobody waits for), later.

The decomposition is the one ``torch.distributed.pipelining`` makes (``_backward.py``), written for one
tensor in and one out. Walking the saved graph from the output: the *input path* is every node from which
the input's gradient node can be reached. A parameter's branch leaves the input path at the nodes whose
gradients it needs (a linear layer's matrix multiply: its weight's gradient needs that node's output
gradient, which the input gradient also passes through). B runs ``torch.autograd.grad`` down to the input
alone, with ``retain_graph`` and a hook on each such *joint* keeping the gradient that reaches it. W then
runs, from each joint with the kept gradient, only the parameter branches: the multiplies by saved
activations that give the weights' gradients, accumulated into ``.grad`` as ``backward`` would.

Every parameter gradient is then the same kernel on the same numbers as in one ``backward`` (bit for bit:
the joint's gradient was summed by the same engine in the same order), provided a parameter takes its
gradient from one joint only; when several (a module applied twice) the sum over joints may be ordered
differently.

A node that computes its input and weight gradients in one call (a custom ``autograd.Function``: the chunked
loss, a ``torch.compile``'d layer's ``CompiledFunctionBackward``) would run in full twice, once in B and once
in W. The parameters whose branches meet the input path at such a node take their gradients in B instead, from
that one call (the same kernel on the same numbers as one ``backward``, accumulated into ``.grad`` in B's
order, which is the microbatches' order): W then skips them. A compiled region's backward cannot even run
with ``retain_graph`` (it donates its saved buffers), so a stage with compiled layers takes every gradient in
B: its W is empty, as under activation checkpointing.

Not for activation checkpointing: a checkpointed region is recomputed once per ``autograd.grad`` call that
unpacks it, so W (one call per group of parameters sharing joints) would recompute each layer many times, and
grouping the calls (``torch.utils.checkpoint.GraphExecGroup``) would hold every layer's recomputed
activations from B until W, more than a checkpointed 1F1B ever holds. The engine runs the plain backward at B
time instead.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


class WeightGradient:
    """The deferred W of one microbatch: call it once. It holds the graph (and so the activations the
    parameter gradients need) until then."""

    def __init__(self, groups: list[tuple[list[Node], list[torch.nn.Parameter]]], captured: dict):
        self._groups, self._captured = groups, captured

    def __call__(self) -> None:
        for joints, params in self._groups:
            self._run(joints, params)
        self._groups, self._captured = [], {}  # frees the graph

    def _run(self, joints: list[Node], params: list[torch.nn.Parameter]) -> None:
        edges, grads = [], []
        for joint in joints:
            for i, grad in enumerate(self._captured.get(joint, ())):
                if grad is not None:
                    edges.append(GradientEdge(joint, i))
                    grads.append(grad)
        if not edges:
            return
        handles = []
        if len(joints) > 1:
            # A joint below another is reached from it too: its own kept gradient must replace what arrives,
            # else that share would be counted twice.
            handles = [j.register_prehook(lambda _, kept=self._captured[j]: kept) for j in joints]
        try:
            weight_grads = torch.autograd.grad(
                edges, [get_gradient_edge(p) for p in params], grads, retain_graph=True, allow_unused=True
            )
        finally:
            for handle in handles:
                handle.remove()
        _accumulate(params, weight_grads)


def backward_input(
    output: torch.Tensor,
    grad_output: torch.Tensor | None,
    input: torch.Tensor,
    params: Iterable[torch.nn.Parameter],
) -> tuple[torch.Tensor, WeightGradient]:
    """B of one microbatch: the gradient of ``input`` (a leaf that requires grad), and the W to run later.
    ``grad_output`` is None for a scalar loss."""
    params = [p for p in params if p.requires_grad]
    root = output.grad_fn
    target = get_gradient_edge(input).node
    parents: dict[Node, list[Node]] = {root: []}
    todo = [root]
    while todo:  # the saved graph, with each node's parents (the nodes whose gradient flows into it)
        node = todo.pop()
        for child, _ in node.next_functions:
            if child is None:
                continue
            if child not in parents:
                parents[child] = []
                todo.append(child)
            parents[child].append(node)
    on_path, todo = {target}, [target]
    while todo:
        for parent in parents[todo.pop()]:
            if parent not in on_path:
                on_path.add(parent)
                todo.append(parent)

    # Parameters whose branches meet the input path at a shared joint form one group (one W call).
    group_of: dict[Node, int] = {}
    groups: list[tuple[set[Node], list[torch.nn.Parameter]]] = []
    for param in params:
        node = get_gradient_edge(param).node
        if node not in parents:
            continue  # unused by this stage's forward
        joints, seen, todo = set(), {node}, [node]
        while todo:
            for parent in parents[todo.pop()]:
                if parent in on_path:
                    joints.add(parent)
                elif parent not in seen:
                    seen.add(parent)
                    todo.append(parent)
        merged = {group_of[j] for j in joints if j in group_of}
        index = min(merged) if merged else len(groups)
        if not merged:
            groups.append((set(), []))
        for other in sorted(merged - {index}):
            groups[index][0].update(groups[other][0])
            groups[index][1].extend(groups[other][1])
            groups[other] = (set(), [])
        groups[index][0].update(joints)
        groups[index][1].append(param)
        for joint in groups[index][0]:
            group_of[joint] = index

    captured: dict[Node, tuple] = {}

    def keep(node):
        def hook(grad_outputs):
            captured[node] = grad_outputs

        return hook

    # Groups meeting the input path at a node that computes every gradient in one call are done in B; all of
    # them when the graph holds a node that cannot run twice (a compiled region's backward donates its
    # buffers: it refuses retain_graph), so that B frees the graph.
    once = any(_runs_once(node) for node in parents)
    now = [(js, ps) for js, ps in groups if ps and (once or any(_single_call(j) for j in js))]
    later = [(js, ps) for js, ps in groups if ps and not (once or any(_single_call(j) for j in js))]
    in_b = [p for _, ps in now for p in ps]
    joints = {j for group, _ in later for j in group}
    handles = [joint.register_prehook(keep(joint)) for joint in joints]
    try:
        grad_input, *grads = torch.autograd.grad(
            output, [input, *in_b], grad_output, retain_graph=bool(later), allow_unused=True
        )
    finally:
        for handle in handles:
            handle.remove()
    _accumulate(in_b, grads)
    ordered = [(sorted(js, key=lambda n: -n._sequence_nr()), ps) for js, ps in later]
    return grad_input, WeightGradient(ordered, captured)


def _runs_once(node: Node) -> bool:
    """Whether ``node``'s backward cannot be run with ``retain_graph`` (``torch.compile``'s compiled regions,
    whose backward reuses (donates) its saved buffers)."""
    return type(node).__name__ == "CompiledFunctionBackward"


def _single_call(node: Node) -> bool:
    """Whether ``node`` computes all its inputs' gradients in one call, whichever are asked for: a custom
    ``autograd.Function``'s backward (``torch.compile``'s ``CompiledFunctionBackward`` is one)."""
    return isinstance(node, torch.autograd.function.BackwardCFunction)


@torch.no_grad()
def _accumulate(params: list[torch.nn.Parameter], grads) -> None:
    """Adds ``grads`` into the parameters' ``.grad``, as ``backward`` does."""
    for param, grad in zip(params, grads):
        if grad is None:
            continue
        if param.grad is None:
            param.grad = grad
        else:
            param.grad += grad
