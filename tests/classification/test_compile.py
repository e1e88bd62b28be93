"""How a classification run compiles (cat.classification.model_building.compile_plan) and steps its optimizer, and
that a compiled training step is one graph that trains as the eager one does."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import timm
import torch
import torch.nn.functional as F

import cat
from cat.classification.model_building import compile_plan
from cat.classification.optimization import step_kwargs
from cat.ops import set_lean_attention
from tests.conftest import typed_cls

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def plan(*overrides: str, device: torch.device = CPU):
    return compile_plan(typed_cls(*overrides), device)


def test_compile_auto_compiles_with_cuda_graphs_on_cuda_and_stays_eager_on_a_cpu():
    """The decision alone, without a GPU: auto compiles on CUDA (replaying the step as CUDA graphs), not on a CPU;
    compile=false opts out everywhere; compile=true compiles on a CPU too, in the default mode."""
    assert (plan(device=CUDA).mode, plan(device=CUDA).fullgraph) == ("reduce-overhead", True)
    assert plan(device=CUDA).line() == (
        "compiled (torch.compile, mode reduce-overhead, one graph): compile=auto on cuda, "
        "compile_mode=auto: CUDA graphs"
    )
    assert plan().mode is None and plan().line() == "eager: compile=auto on cpu (compiles on CUDA only)"
    assert plan("compile=false", device=CUDA).mode is None
    assert plan("compile=true").mode == "default" and plan("compile=true", "compile_mode=max-autotune").mode == (
        "max-autotune"
    )


def test_lean_attention_relaxes_fullgraph_and_says_so():
    """The lean function runs outside the compiled graph (its backward recomputes what a traced forward would keep),
    so compiling it whole would fail at the first step: fullgraph is relaxed for it, and the line says why."""
    lean = plan("compile=true", "model.lean_attention=true")
    assert lean.fullgraph is False and "fullgraph relaxed: lean_attention=true" in lean.line()
    assert plan("compile=true", "model.lean_attention=auto").fullgraph is True
    assert plan("compile=true", "compile_fullgraph=false").fullgraph is False


def test_adam_steps_fused_on_cuda_unless_the_config_says_otherwise():
    assert step_kwargs("adamw", CUDA, {}) == {"fused": True} and step_kwargs("AdamW", CUDA, {}) == {"fused": True}
    assert step_kwargs("adamw", CPU, {}) == {}  # torch's default step
    assert step_kwargs("lamb", CUDA, {}) == {}  # no fused step: torch's (or timm's) own choice
    assert step_kwargs("adamw", CUDA, {"foreach": False}) == {} and step_kwargs("adam", CUDA, {"fused": False}) == {}
    optimizer = timm.optim.create_optimizer_v2(torch.nn.Linear(2, 2), opt="adamw", lr=1e-3, fused=True)
    assert optimizer.defaults["fused"] is True  # timm passes it on to torch's AdamW


def build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "converted":
        return cat.convert(timm.create_model("deit_tiny_patch16_224", img_size=32, depth=2, num_classes=5))
    model = timm.create_model("ca_deit_tiny", img_size=32, depth=2, num_classes=5)
    return set_lean_attention(model, True) if name == "lean" else model


@pytest.mark.slow  # Inductor compiles a forward and a backward: ~30 s each
@pytest.mark.parametrize("name", ["ca_deit_tiny", "converted", "lean"])
def test_a_compiled_training_step_is_one_graph_and_trains_as_eager(name):
    """CA-DeiT-T and a cat.convert-ed DeiT-T: torch.compile (Inductor) with fullgraph=True makes the forward and its
    backward one graph each (no break: fullgraph would raise, and dynamo's explanation counts none), and three full
    steps (forward, cross-entropy, backward, AdamW) give the eager losses. With lean_attention=true, compiled as a run
    compiles it (fullgraph relaxed, :func:`compile_plan`): the lean function runs between graphs, and trains alike."""
    model = build(name)
    x, target = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    explanation = torch._dynamo.explain(model)(x)
    if name == "lean":  # breaks around the lean function, which runs uncompiled
        reasons = " ".join(str(reason) for reason in explanation.break_reasons)
        assert explanation.graph_break_count > 0 and "torch.compiler.disable" in reasons
    else:
        assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    torch._dynamo.reset()
    eager = copy.deepcopy(model)
    fullgraph = compile_plan(typed_cls("compile=true", f"model.lean_attention={name == 'lean'}"), CPU).fullgraph
    assert fullgraph is (name != "lean")
    compiled = torch.compile(model, fullgraph=fullgraph)
    losses: dict[str, list[float]] = {"compiled": [], "eager": []}
    for label, forward, module in (("compiled", compiled, model), ("eager", eager, eager)):
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
        for _ in range(3):
            loss = F.cross_entropy(forward(x), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[label].append(loss.item())
    torch._dynamo.reset()
    assert losses["eager"][2] < losses["eager"][0]  # it trains: not a comparison of two stuck runs
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4, abs=1e-5)


def test_a_trained_plan_is_what_the_config_record_says():
    """The plan reads the typed config only (compile, compile_mode, compile_fullgraph, model.lean_attention)."""
    cfg = typed_cls("compile=true")
    changed = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, lean_attention=True))
    assert compile_plan(changed, CPU).fullgraph is False and compile_plan(cfg, CPU).fullgraph is True
