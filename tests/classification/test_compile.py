"""How a classification run compiles (cat.classification.model_building.compile_plan) and steps its optimizer, and
that a compiled training step is one graph that trains as the eager one does."""

from __future__ import annotations

import copy
import dataclasses
import os

import pytest
import timm
import torch
import torch.nn.functional as F

import cat
from cat.classification.model_building import compile_plan, compiled
from cat.classification.optimization import step_kwargs
from cat.ops import set_lean_attention
from tests import prewarmed
from tests.conftest import REPO, typed_cls
from tests.subprocess_output import TAIL_CHARS

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


def build(name: str, depth: int = 1) -> torch.nn.Module:
    """A small model of the kind ``name``; one block (the default) holds every operator a compiled step meets, and
    Inductor's time grows with the blocks."""
    torch.manual_seed(0)
    if name == "converted":
        return cat.convert(timm.create_model("deit_tiny_patch16_224", img_size=32, depth=depth, num_classes=5))
    model = timm.create_model("ca_deit_tiny", img_size=32, depth=depth, num_classes=5)
    return set_lean_attention(model, True) if name == "lean" else model


def assert_one_graph(model: torch.nn.Module, x: torch.Tensor) -> None:
    """Dynamo's explanation of the forward counts one graph and no break (fullgraph=True would raise on one too)."""
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    torch._dynamo.reset()


# CA-DeiT-T's own compiled step is test_accumulated_compiled_steps_train_as_eager_in_stable_buffers's: one Inductor
# compilation of it in the file (tens of seconds on 2 cores with a cold cache, as CI's always is).
@pytest.mark.slow  # Inductor compiles a forward and a backward: ~30 s each
@pytest.mark.parametrize("name", ["converted", "lean"])
def test_a_compiled_training_step_is_one_graph_and_trains_as_eager(name):
    """A cat.convert-ed DeiT-T: torch.compile (Inductor) with fullgraph=True makes the forward and its backward one
    graph each, and three full steps (forward, cross-entropy, backward, AdamW) give the eager losses. With
    lean_attention=true, compiled as a run compiles it (fullgraph relaxed, :func:`compile_plan`): the lean function
    runs between graphs, and trains alike."""
    model = build(name)
    x, target = torch.randn(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    if name == "lean":  # breaks around the lean function, which runs uncompiled
        explanation = torch._dynamo.explain(model)(x)
        reasons = " ".join(str(reason) for reason in explanation.break_reasons)
        assert explanation.graph_break_count > 0 and "torch.compiler.disable" in reasons
        torch._dynamo.reset()
    else:
        assert_one_graph(model, x)
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


def test_accumulation_under_cuda_graphs_keeps_its_gradients_in_stable_buffers():
    """Under CUDA graphs a kept .grad would be a graph's output that the next replay overwrites (torch's own error:
    "accessing gradient tensor output of CUDAGraphs that has been overwritten"): with accum_steps >= 2 the plan keeps
    the gradients in buffers allocated once and cleared in place, and says so."""
    cuda_graphs = plan("accum_steps=2", device=CUDA)
    assert cuda_graphs.mode == "reduce-overhead" and cuda_graphs.stable_grads
    assert "accum_steps=2 under CUDA graphs: gradients accumulate in buffers allocated once" in cuda_graphs.line()
    assert not plan(device=CUDA).stable_grads  # one micro-batch: the optimizer reads the outputs before the replay
    assert not plan("accum_steps=2", "compile_mode=default", device=CUDA).stable_grads
    assert plan("compile=true", "compile_mode=max-autotune", "accum_steps=4").stable_grads


def test_several_processes_compile_the_ddp_module_so_its_buckets_split_the_graph():
    several = compile_plan(typed_cls("compile=true"), CPU, world_size=2)
    assert several.compile_ddp and several.fullgraph is False
    assert "the DDP module is compiled, so the graph splits at gradient buckets" in several.line()
    assert not compile_plan(typed_cls("compile=true"), CPU).compile_ddp


def test_lean_auto_follows_the_memory_rule_when_compiled():
    """At a budget where the rule says lean, a compiled forward takes the lean function (outside the graph, as
    eagerly), the probe finds every block, and the plan relaxes fullgraph and says why; at a roomy budget, none."""
    from cat.classification.model_building import lean_blocks
    from cat.ops import set_attention_memory
    from cat.runtime import Precision

    model = build("ca_deit_tiny", depth=2)
    x = torch.randn(4, 3, 32, 32)
    for memory_mb, lean in ((1, True), (4096, False)):
        set_attention_memory(model, memory_mb)
        blocks = lean_blocks(model, tuple(x.shape), Precision(CPU))
        assert blocks == (2 if lean else 0)
        assert model.training  # the probe leaves the model as it found it, its constants real
        assert torch.isfinite(model(x)).all()
        explanation = torch._dynamo.explain(model)(x)
        reasons = " ".join(str(reason) for reason in explanation.break_reasons)
        assert ("torch.compiler.disable" in reasons) is lean
        torch._dynamo.reset()
        relaxed = compile_plan(typed_cls("compile=true"), CPU, lean_blocks=blocks)
        assert relaxed.fullgraph is not lean
        assert ("lean_attention=auto takes the lean function for 2 attention blocks" in relaxed.line()) is lean


@pytest.mark.slow  # Inductor compiles a forward and a backward
def test_accumulated_compiled_steps_train_as_eager_in_stable_buffers():
    """CA-DeiT-T's forward is one graph, and compiled with fullgraph=True as a run compiles it, in the CUDA-graph mode
    the plan keeps stable gradients for (on a CPU, Inductor runs it without CUDA graphs): three optimizer steps of two
    micro-batches each keep the gradients in the same buffers across micro-batches and steps, and give the eager
    run's losses."""
    from timm.scheduler import create_scheduler_v2

    from cat.classification.loops import TrainOptions, train_step
    from cat.classification.state import TrainState

    cfg = typed_cls("compile=true", "compile_mode=reduce-overhead", "accum_steps=2")
    compiled_plan = compile_plan(cfg, CPU)
    assert compiled_plan.stable_grads and compiled_plan.fullgraph
    torch.manual_seed(0)
    # The same two micro-batches every step: a loss that must fall, whatever the numerics of one run.
    batches = [(torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,))) for _ in range(2)] * 3
    assert_one_graph(build("ca_deit_tiny"), batches[0][0])
    losses, pointers = {}, set()
    for label in ("eager", "compiled"):
        model = build("ca_deit_tiny")
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        schedule, _ = create_scheduler_v2(optimizer, sched="constant", num_epochs=1, updates_per_epoch=3)
        state = TrainState(model, optimizer, schedule, torch.amp.GradScaler("cpu", enabled=False))
        if label == "compiled":
            state.train_model = compiled(compiled_plan, model)
            state.stable_grads = compiled_plan.stable_grads
        steps = []
        for step in range(3):
            micro = batches[2 * step : 2 * step + 2]
            steps.append(train_step(state, micro, TrainOptions(steps_per_epoch=3, accum_steps=2)).loss.item())
            if label == "compiled":
                pointers.add(tuple(p.grad.data_ptr() for p in model.parameters()))
        losses[label] = steps
    torch._dynamo.reset()
    assert len(pointers) == 1  # the same buffers after every step
    assert losses["eager"][2] < losses["eager"][0]
    assert losses["compiled"] == pytest.approx(losses["eager"], rel=1e-4, abs=1e-5)


def _ddp_rank(rank: int, store: str, out: str) -> None:
    """One of two gloo processes: three DDP steps eagerly, then three of the same model compiled as a run compiles it
    with two processes (:func:`cat.classification.trainer._wrap_for_training`), AOTAutograd's graphs counted."""
    import json
    import unittest.mock

    import torch.distributed as dist
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch.nn.parallel import DistributedDataParallel

    from cat.classification.trainer import _wrap_for_training
    from cat.runtime.dist import DistEnv

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    backward_graphs = []

    def kept(graph, inputs):
        return make_boxed_func(graph.forward)

    def counted(graph, inputs):
        backward_graphs.append(graph)
        return make_boxed_func(graph.forward)

    # AOTAutograd's graphs run as traced (Inductor's numerics are test_a_compiled_training_step_...'s business).
    backend = aot_autograd(fw_compiler=kept, bw_compiler=counted)
    real_compile = torch.compile
    env = DistEnv(rank=rank, world_size=2)
    plan = compile_plan(typed_cls("compile=true"), CPU, world_size=2)
    torch.manual_seed(1)
    batches = [(torch.randn(4, 3, 32, 32), torch.randint(0, 5, (4,)))] * 3  # one batch: the loss must fall
    losses = {}
    for label in ("eager", "compiled"):
        torch.manual_seed(0)  # 1.0 M parameters (4 MB): four buckets of 1 MB
        model = timm.create_model("ca_deit_tiny", img_size=32, depth=2, patch_size=8, num_classes=5)
        if label == "eager":
            forward = DistributedDataParallel(model, bucket_cap_mb=1)
        else:
            with unittest.mock.patch.object(
                torch,
                "compile",
                lambda module, mode, fullgraph: real_compile(module, backend=backend, fullgraph=fullgraph),
            ):
                forward = _wrap_for_training(plan, env, model)
            forward._orig_mod.bucket_bytes_cap = 1 << 20  # what DDP(bucket_cap_mb=1) sets, read at the first call
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[label] = []
        for images, targets in batches:
            images = images + rank  # each rank its own batch: the all-reduce must matter
            loss = F.cross_entropy(forward(images), targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses[label].append(loss.item())
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"losses": losses, "backward_graphs": len(backward_graphs)}, f)
    dist.destroy_process_group()


@pytest.mark.slow  # two processes, each tracing a DDP-split graph
def test_two_process_compiled_ddp_splits_at_buckets_and_trains_as_eager(tmp_path):
    """compile=true with two processes: the DDP module is compiled, dynamo's DDP optimizer splits it at the gradient
    buckets (several backward graphs, one per bucket, each bucket's all-reduce free to start as its graph ends), and
    three steps give eager DDP's losses."""
    import json
    import subprocess
    import sys
    import time

    out = tmp_path / "out.json"
    # Each rank a process of its own, forked from the prewarmed interpreter: torch, timm and cat already imported.
    # Its output goes to a file (a full pipe would stall it while the other is waited for).
    logs = [tmp_path / f"rank{rank}.log" for rank in (0, 1)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = []
    for rank, log in enumerate(logs):
        code = f"from {__name__} import _ddp_rank; _ddp_rank({rank}, {str(tmp_path / 'store')!r}, {str(out)!r})"
        with open(log, "w") as output:
            procs.append(
                prewarmed.Popen(
                    [sys.executable, "-c", code], cwd=REPO, env=env, stdout=output, stderr=subprocess.STDOUT
                )
            )
    # Until both end, one fails (the other would wait on it in gloo) or five minutes pass; then none is left running.
    deadline = time.monotonic() + 300
    while any(p.poll() is None for p in procs) and not any(p.poll() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log.read_text()[-TAIL_CHARS:] for log in logs)
    result = json.loads(out.read_text())
    assert result["backward_graphs"] > 1
    assert result["losses"]["eager"][2] < result["losses"]["eager"][0]
    assert result["losses"]["compiled"] == pytest.approx(result["losses"]["eager"], rel=1e-4, abs=1e-5)
