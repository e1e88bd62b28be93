"""Where mmengine's hooks, visualizer, backends and metrics write is checked where it lands: the runner's final config
(built by the task, with the user's ``+mm=`` options merged) resolved as mmengine resolves each path, by the component
that writes it and not by its key's name; and an option a component does not take is refused before the first step."""

from __future__ import annotations

import os
import re

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
    # mmengine's evaluator form without a type, and its collect_dir (gathered into, then deleted)
    (
        "det",
        "{val_evaluator: {_delete_: true, metrics: [{type: DumpResults, out_file_path: OUT/dump.pkl}]}}",
        "mm.val_evaluator.metrics[0].out_file_path",
    ),
    (
        "det",
        "{val_evaluator: [{type: DumpResults, out_file_path: RUN/d.pkl, collect_dir: OUT}]}",
        "mm.val_evaluator[0].collect_dir",
    ),
    (
        "det",
        "{val_evaluator: [{type: DumpProposals, output_dir: RUN, proposals_file: OUT/props.pkl}]}",
        "mm.val_evaluator[0].proposals_file",
    ),
    (
        "seg",
        "{visualizer: {vis_backends: [{type: WandbVisBackend, save_dir: RUN/wb, init_kwargs: {dir: OUT}}]}}",
        "mm.visualizer.vis_backends[0].init_kwargs.dir",
    ),
    ("det", "{default_hooks.checkpoint.out_dir: 5}", "mm.default_hooks.checkpoint: out_dir must be a path"),
    ("seg", "{visualizer: {save_dir: 7}}", "mm.visualizer: save_dir must be a path (a string); got int 7"),
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
    option = option.replace("OUT", str(tmp_path / "elsewhere")).replace("RUN", str(tmp_path / "run"))
    mm = _final_config(task, tmp_path, toy_coco, toy_ade, option)
    problems = write_problems(mm, str(tmp_path / "run"))
    assert len(problems) == 1 and problems[0].startswith(named), problems
    assert any(words in problems[0] for words in ("outside the run folder", "in the run folder", "must be")), problems


@pytest.mark.parametrize(
    ("task", "option"),
    [
        ("det", "{default_hooks.checkpoint.filename_tmpl: 'ckpt_{}.pth'}"),
        ("seg", "{custom_hooks: [{type: EMAHook}]}"),
        ("seg", "{visualizer: {vis_backends: [{type: LocalVisBackend, img_save_dir: pictures}]}}"),
        ("det", "{default_hooks.visualization.test_out_dir: painted}"),  # under the run's log folder
        # a tracking server's URI is not a path
        (
            "seg",
            "{visualizer: {vis_backends: [{type: MLflowVisBackend, save_dir: RUN/ml, tracking_uri: 'http://127.0.0.1:5000'}]}}",
        ),
    ],
)
def test_a_write_inside_the_run_folder_is_taken(task, option, toy_coco, toy_ade, tmp_path):
    from cat.mm import DET, SEG
    from cat.mm.writes import write_problems

    (DET if task == "det" else SEG).register_modules()
    option = option.replace("RUN", str(tmp_path / "run"))
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
    """Through train_det.py / train_seg.py, hooks, a backend and a metric: one line, exit 2, nothing written outside
    the run folder, no step taken (the issue's 146 MB checkpoint written over a file outside is never written)."""
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "x_1.pth").write_text("theirs")
    cases = {
        "det": {
            "template": [f"+mm={{default_hooks.checkpoint.filename_tmpl: '{outside}/x_{{}}.pth'}}"],
            "misspelt": ["+mm={default_hooks.checkpoint.intervall: 2}"],
            "metric": [f"+mm={{val_evaluator: [{{type: DumpResults, out_file_path: {outside}/x_1.pth}}]}}"],
        },
        "seg": {
            "backend": [f"+mm={{visualizer: {{vis_backends: [{{type: LocalVisBackend, save_dir: {outside}}}]}}}}"],
            "hook_list": [f"+mm={{custom_hooks: [{{type: CheckpointHook, out_dir: {outside}}}]}}"],
        },
    }
    expected = {
        "template": "mm.default_hooks.checkpoint.filename_tmpl: CheckpointHook would write",
        "misspelt": "mm.default_hooks.checkpoint.intervall: CheckpointHook takes no option 'intervall'",
        "metric": "mm.val_evaluator[0].out_file_path: DumpResults would write",
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


@pytest.mark.parametrize(
    ("task", "option", "named"),
    [
        ("det", "{custom_hooks: [{type: os.system, command: 'touch MARK'}]}", "mm.custom_hooks[0].type='os.system'"),
        ("seg", "{custom_hooks: [{type: builtins.int}]}", "mm.custom_hooks[0].type='builtins.int'"),
        ("det", "{val_evaluator: {metrics: [{type: builtins.eval}]}}", "mm.val_evaluator.metrics[0].type"),
        ("seg", "{model: {decode_head: {type: subprocess.Popen}}}", "mm.model.decode_head.type='subprocess.Popen'"),
    ],
)
def test_a_type_that_is_not_a_registered_name_is_refused_before_anything_imports_it(
    task, option, named, toy_coco, toy_ade, tmp_path
):
    """mmengine's registries import any dotted name they are handed; the check reads the registries only."""
    from cat.mm import DET, SEG
    from cat.mm.registered import type_problems

    (DET if task == "det" else SEG).register_modules()
    problems = type_problems(_final_config(task, tmp_path, toy_coco, toy_ade, option))
    assert len(problems) == 1 and problems[0].startswith(named), problems
    assert "not a component the OpenMMLab registries hold" in problems[0]


@pytest.mark.parametrize(
    "option",
    [
        "{}",  # every type of both packaged bases, as cat builds them
        "{custom_hooks: [{type: mmengine.hooks.EMAHook}]}",  # a dotted path to a registered class
        "{custom_hooks: [{type: mmengine.EMAHook}]}",  # a scoped name
    ],
)
@pytest.mark.parametrize("task", ["det", "seg"])
def test_registered_names_scoped_names_and_paths_to_registered_classes_are_taken(
    task, option, toy_coco, toy_ade, tmp_path
):
    from cat.mm import DET, SEG
    from cat.mm.registered import type_problems

    (DET if task == "det" else SEG).register_modules()
    assert type_problems(_final_config(task, tmp_path, toy_coco, toy_ade, option)) == []


def _types(entries) -> list[str]:
    return [entry["type"] for entry in entries]


def test_cats_hooks_and_backend_survive_a_users_lists(toy_coco, toy_ade, tmp_path):
    """mmengine's merge puts a user's list in the base's place; cat adds its own back (preemption, portable
    checkpoints, the resume record, metrics.jsonl), unless the user says otherwise."""
    own = ["PreemptionHook", "PortableCheckpointHook", "RunConfigHook"]
    mm = _final_config(
        "seg",
        tmp_path,
        toy_coco,
        toy_ade,
        "{custom_hooks: [{type: EMAHook}], visualizer: {vis_backends: [{type: LocalVisBackend}]}}",
    )
    assert _types(mm.custom_hooks) == ["EMAHook", *own]
    assert _types(mm.visualizer.vis_backends) == ["LocalVisBackend", "MetricSinkBackend"]
    mm = _final_config("seg", tmp_path, toy_coco, toy_ade, "{custom_hooks: [{type: EMAHook}], cat_hooks: false}")
    assert _types(mm.custom_hooks) == ["EMAHook"] and "cat_hooks" not in mm
    mm = _final_config(
        "det",
        tmp_path,
        toy_coco,
        toy_ade,
        "{visualizer: {_delete_: true, type: Visualizer, vis_backends: [{type: LocalVisBackend}]}}",
    )
    assert _types(mm.visualizer.vis_backends) == ["LocalVisBackend"]
    assert _types(_final_config("det", tmp_path, toy_coco, toy_ade, "{}").custom_hooks) == own


def test_mmdets_own_clip_grad_merges(toy_coco, toy_ade, tmp_path):
    mm = _final_config("det", tmp_path, toy_coco, toy_ade, "{optim_wrapper: {clip_grad: {max_norm: 35, norm_type: 2}}}")
    assert mm.optim_wrapper.clip_grad == {"max_norm": 35, "norm_type": 2}


@pytest.mark.parametrize(
    ("option", "expected"),
    [
        ("{custom_hooks: {type: EMAHook}}", "mm.custom_hooks must be a list; got dict"),
        ("{train_dataloader: {batch_size: {x: 1}}}", "+mm={train_dataloader: ...} does not merge"),
    ],
)
def test_an_option_that_does_not_fit_the_config_is_one_line(option, expected, toy_coco, toy_ade, tmp_path):
    from cat.errors import ConfigError

    with pytest.raises(ConfigError, match=re.escape(expected)):
        _final_config("seg", tmp_path, toy_coco, toy_ade, option)
