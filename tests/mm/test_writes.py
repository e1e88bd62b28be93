"""Where mmengine's hooks, visualizer, backends and metrics write is checked where it lands: the runner's final config
(built by the task, with the user's ``+mm=`` options merged) resolved as mmengine resolves each path, by the component
that writes it and not by its key's name; and an option a component does not take is refused before the first step."""

from __future__ import annotations

import os

import pytest

from cat.runtime.dist import DistEnv
from tests.conftest import compose_config, mm_builder, refusal_line
from tests.entry_cases import run_entry_cases

pytest.importorskip("mmdet", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")
pytest.importorskip("mmseg", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")

# (task, +mm= option with OUT standing for a folder outside the run, what the refusal names)
OUTSIDE = [
    ("det", "{default_hooks.checkpoint.filename_tmpl: 'OUT/x_{}.pth'}", "mm.default_hooks.checkpoint.filename_tmpl"),
    ("det", "{default_hooks.checkpoint.filename_tmpl: '../../x_{}.pth'}", "mm.default_hooks.checkpoint.filename_tmpl"),
    ("det", "{default_hooks.checkpoint.out_dir: OUT}", "mm.default_hooks.checkpoint.out_dir"),
    ("seg", "{custom_hooks: [{type: CheckpointHook, out_dir: OUT}]}", "mm.custom_hooks[0].out_dir"),
    (
        "seg",
        "{visualizer: {vis_backends: [{type: LocalVisBackend, save_dir: OUT}]}}",
        "mm.visualizer.vis_backends[0].save_dir",
    ),
    (
        "det",
        "{visualizer: {vis_backends: [{type: LocalVisBackend, img_save_dir: OUT}]}}",
        "mm.visualizer.vis_backends[0].img_save_dir",
    ),
    ("seg", "{visualizer: {save_dir: OUT}}", "mm.visualizer.save_dir"),
    ("det", "{default_hooks.logger.out_dir: OUT}", "mm.default_hooks.logger.out_dir"),
    ("det", "{default_hooks.visualization.test_out_dir: OUT}", "mm.default_hooks.visualization.test_out_dir"),
    ("det", "{test_evaluator.outfile_prefix: OUT/results}", "mm.test_evaluator.outfile_prefix"),
    ("seg", "{custom_hooks: [{type: ProfilerHook, json_trace_path: OUT/trace.json}]}", "mm.custom_hooks[0]"),
    ("det", "{work_dir: OUT}", "mm.work_dir"),
]


def _final_config(task, tmp_path, toy_coco, toy_ade, option):
    root = toy_coco if task == "det" else toy_ade
    cfg = compose_config(task, f"data.root={root}", f"output_dir={tmp_path / 'run'}", f"+mm={option}")
    return mm_builder(task)(cfg, DistEnv(), str(tmp_path / "run"))


@pytest.mark.parametrize(("task", "option", "named"), OUTSIDE, ids=[o for _, o, _ in OUTSIDE])
def test_a_write_outside_the_run_folder_is_refused_by_where_it_lands(task, option, named, toy_coco, toy_ade, tmp_path):
    from cat.mm import DET, SEG
    from cat.mm.writes import write_problems

    (DET if task == "det" else SEG).register_modules()
    mm = _final_config(task, tmp_path, toy_coco, toy_ade, option.replace("OUT", str(tmp_path / "elsewhere")))
    problems = write_problems(mm, str(tmp_path / "run"))
    assert len(problems) == 1 and problems[0].startswith(named), problems
    assert "outside the run folder" in problems[0] or "in the run folder" in problems[0], problems


@pytest.mark.parametrize(
    ("task", "option"),
    [
        ("det", "{default_hooks.checkpoint.filename_tmpl: 'ckpt_{}.pth'}"),
        ("seg", "{custom_hooks: [{type: EMAHook}]}"),
        ("seg", "{visualizer: {vis_backends: [{type: LocalVisBackend, img_save_dir: pictures}]}}"),
        ("det", "{default_hooks.visualization.test_out_dir: painted}"),  # under the run's log folder
    ],
)
def test_a_write_inside_the_run_folder_is_taken(task, option, toy_coco, toy_ade, tmp_path):
    from cat.mm import DET, SEG
    from cat.mm.writes import write_problems

    (DET if task == "det" else SEG).register_modules()
    assert write_problems(_final_config(task, tmp_path, toy_coco, toy_ade, option), str(tmp_path / "run")) == []


@pytest.mark.parametrize(
    ("task", "option", "expected"),
    [
        (
            "det",
            "{default_hooks.checkpoint.intervall: 2}",
            "mm.default_hooks.checkpoint.intervall: CheckpointHook takes no option 'intervall' (it takes",
        ),
        (
            "seg",
            "{default_hooks.visualization.test_out_dir: painted}",
            "mm.default_hooks.visualization.test_out_dir: SegVisualizationHook takes no option 'test_out_dir'",
        ),
        ("seg", "{custom_hooks: [{type: CheckpointHok}]}", "mm.custom_hooks[0].type='CheckpointHok': no hook of"),
        (
            "det",
            "{default_hooks.checkpoint.filename_tmpl: 'x_{1}.pth'}",
            "mm.default_hooks.checkpoint: 'x_{1}.pth' is not a checkpoint name with one {}",
        ),
    ],
)
def test_an_option_a_component_does_not_take_is_refused(task, option, expected, toy_coco, toy_ade, tmp_path):
    from cat.mm import DET, SEG
    from cat.mm.writes import write_problems

    (DET if task == "det" else SEG).register_modules()
    problems = write_problems(_final_config(task, tmp_path, toy_coco, toy_ade, option), str(tmp_path / "run"))
    assert len(problems) == 1 and problems[0].startswith(expected), problems


@pytest.mark.slow
def test_the_trainers_refuse_them_in_one_line_before_the_first_step(toy_coco, toy_ade, tmp_path):
    """Through train_det.py / train_seg.py: one line, exit 2, nothing written outside the run folder, no step taken
    (the issue's 146 MB checkpoint written over a file outside is never written)."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "x_1.pth").write_text("theirs")
    cases = {
        "det": {
            "template": [f"+mm={{default_hooks.checkpoint.filename_tmpl: '{outside}/x_{{}}.pth'}}"],
            "misspelt": ["+mm={default_hooks.checkpoint.intervall: 2}"],
        },
        "seg": {
            "backend": [f"+mm={{visualizer: {{vis_backends: [{{type: LocalVisBackend, save_dir: {outside}}}]}}}}"],
            "hook_list": [f"+mm={{custom_hooks: [{{type: CheckpointHook, out_dir: {outside}}}]}}"],
        },
    }
    expected = {
        "template": "mm.default_hooks.checkpoint.filename_tmpl: CheckpointHook would write",
        "misspelt": "mm.default_hooks.checkpoint.intervall: CheckpointHook takes no option 'intervall'",
        "backend": "mm.visualizer.vis_backends[0].save_dir: LocalVisBackend would write",
        "hook_list": "mm.custom_hooks[0].out_dir: CheckpointHook would write",
    }
    for task, named in cases.items():
        root = toy_coco if task == "det" else toy_ade
        runs = run_entry_cases(
            f"train_{task}.py",
            {
                name: [f"data.root={root}", f"output_dir={tmp_path / name}", "logger.wandb.mode=disabled", *args]
                for name, args in named.items()
            },
        )
        for name, run in runs.items():
            assert run.returncode == 2, run.stderr[-2000:]
            assert expected[name] in refusal_line(run), refusal_line(run)
            assert not any(p.suffix == ".pth" for p in (tmp_path / name).iterdir())
    assert sorted(os.listdir(outside)) == ["x_1.pth"] and (outside / "x_1.pth").read_text() == "theirs"
