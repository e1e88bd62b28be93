"""A model's compiled CUDA step, traced on a machine with no GPU: its parameters and inputs become fake CUDA tensors
(sizes, dtypes and a CUDA device, no data), dynamo traces the step as ``torch.compile`` would for a GPU, and the
graphs it makes are read node by node.

What a graph traced this way shows is what Inductor would be handed on a GPU: every operator the step runs in the
graph, the device each one's result lives on, and the forward and backward of every ``torch.autograd.Function`` (dynamo
traces both into the graph). What it cannot show is autograd's own derivatives of aten operators, which AOTAutograd
adds later; those make no constants of their own.
"""

from __future__ import annotations

import unittest.mock
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.fx
from torch import Tensor, nn

__all__ = ["FakeCudaStep", "fake_cuda_module", "fake_cuda_step", "host_nodes"]


@dataclass
class FakeCudaStep:
    """What :func:`fake_cuda_step` traced: the graphs dynamo made (several where the step breaks), their nodes with
    every nested graph's (an autograd.Function's forward and backward bodies), and the step's output."""

    graphs: list[torch.fx.GraphModule]
    nodes: list[torch.fx.Node]
    output: object


def fake_cuda_module(model: nn.Module, mode: object) -> None:
    """Every parameter and buffer of ``model`` replaced by a fake CUDA tensor of its size and dtype, in place."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                fake = mode.from_tensor(param.detach()).to("cuda")  # type: ignore[attr-defined]
                module._parameters[name] = nn.Parameter(fake, requires_grad=param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = mode.from_tensor(buffer).to("cuda")  # type: ignore[attr-defined]


def _walk(graph: torch.fx.GraphModule) -> Iterator[torch.fx.Node]:
    for node in graph.graph.nodes:
        yield node
        if node.op == "get_attr" and isinstance(sub := getattr(graph, str(node.target), None), torch.fx.GraphModule):
            yield from _walk(sub)


def fake_cuda_step(
    model: nn.Module,
    step: Callable[[nn.Module, Tensor, Tensor], object],
    batch: tuple[int, ...],
    targets: int,
    fullgraph: bool = True,
) -> FakeCudaStep:
    """Trace ``step(model, images, targets)`` with dynamo as ``torch.compile(..., fullgraph=fullgraph)`` would on a
    GPU, on fake CUDA tensors: ``model`` (whose weights are replaced, in place, by fake CUDA tensors: pass a model
    made for it), random images of shape ``batch`` and class indices below ``targets``. Nothing runs on a GPU, and
    nothing but the trace runs at all: the graphs are kept, not compiled."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    graphs: list[torch.fx.GraphModule] = []

    def capture(graph: torch.fx.GraphModule, example_inputs: list) -> Callable:
        graphs.append(graph)
        return graph.forward

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        fake_cuda_module(model, mode)
        images = torch.randn(batch, device="cuda")
        labels = torch.randint(0, targets, (batch[0],), device="cuda")
    torch._dynamo.reset()
    # CUDA's autocast said to be there, with bf16: torch.autocast("cuda") would turn itself off on a machine without a
    # GPU (and refuse bf16 there).
    try:
        with (
            mode,
            unittest.mock.patch("torch.cuda.amp.common.amp_definitely_not_available", lambda: False),
            unittest.mock.patch("torch.cuda.is_bf16_supported", lambda including_emulation=True: True),
        ):
            output = torch.compile(step, backend=capture, fullgraph=fullgraph)(model, images, labels)
    finally:
        torch._dynamo.reset()
    return FakeCudaStep(graphs, [node for graph in graphs for node in _walk(graph)], output)


def _tensors(value: object) -> list[Tensor]:
    return [t for t in torch.utils._pytree.tree_leaves(value) if isinstance(t, Tensor)]


def host_nodes(nodes: list[torch.fx.Node]) -> list[str]:
    """The nodes of a graph traced for CUDA that make a tensor on the CPU, or move one between devices: each would
    run on the host, and each copy to the GPU makes the host wait for it. One line per node (what it calls, where its
    result lives). A graph's scalar inputs (0-dim host tensors: a Python float of a module that dynamo does not
    specialise) are not among them: Inductor passes them to its kernels as arguments."""
    found = []
    for node in nodes:
        made = _tensors(node.meta.get("example_value"))
        if node.op == "placeholder" and all(t.dim() == 0 for t in made):
            continue
        used = _tensors([arg.meta.get("example_value") for arg in node.all_input_nodes])
        on_cpu = [t for t in made if t.device.type == "cpu"]
        moved = {t.device.type for t in used} - {t.device.type for t in made} if made and used else set()
        if on_cpu or moved:
            where = "cpu" if on_cpu else f"{'/'.join(sorted(moved))} -> {made[0].device.type}"
            found.append(f"{node.op} {node.target} ({where}): {str(node.format_node())[:160]}")
    return found
