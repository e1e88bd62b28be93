"""The typed configuration: every key of every task typed and documented, every shipped preset
conforming, and the checker's verdicts on hand-made configs (in-process, no training)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import pytest
from omegaconf import OmegaConf

from cat.classification.schema import ClsConfig
from cat.mm.schema import DetConfig, SegConfig
from cat.runtime.config_help import schema_help
from cat.runtime.schema import key, schema_keys, schema_of, schema_problems, section
from tests.conftest import REPO, checked_config, compose_config, run_folder

SCHEMAS = {"cls": ClsConfig, "det": DetConfig, "seg": SegConfig}


def _presets(task: str) -> list[str]:
    return sorted(p.stem for p in (REPO / "configs" / task / "experiment").glob("*.yaml"))


@pytest.mark.parametrize("task", sorted(SCHEMAS))
def test_every_key_has_a_type_and_a_doc(task):
    keys = list(schema_keys(SCHEMAS[task]))
    assert len(keys) > 40
    for path, expected, doc in keys:
        assert expected != "anything" and len(doc) >= 8, path
    assert schema_of(task) is SCHEMAS[task]  # registered in Hydra's ConfigStore as schema/<task>


def _preset_cases() -> list:
    """Every task's presets; the quick tier checks each task's first, the full suite all."""
    return [
        (task, e) if k == 0 else pytest.param(task, e, marks=pytest.mark.slow)
        for task in sorted(SCHEMAS)
        for k, e in enumerate(_presets(task))
    ]


@pytest.mark.parametrize(("task", "experiment"), _preset_cases(), ids=str)
def test_every_shipped_preset_conforms(task, experiment):
    """Every key an experiment composes is one the schema knows, of its type and in its range."""
    cfg = compose_config(task, f"experiment={experiment}")
    assert schema_problems(cfg, SCHEMAS[task]) == []


@pytest.mark.parametrize("data", ["digits", "folder", "imagenet", "synthetic"])
def test_every_dataset_option_conforms(data):
    assert schema_problems(compose_config("cls", f"data={data}"), ClsConfig) == []


@pytest.mark.parametrize(
    ("override", "problem"),
    [
        ("schedule.sched=bogus", "schedule.sched='bogus': expected one of cosine, tanh"),
        ("model.drop_path_rate=-1", "model.drop_path_rate=-1: expected a number >= 0 and <= 1 (or null)"),
        ("model.lean_attention=maybe", "model.lean_attention='maybe': expected one of auto, True, False"),
        ("aug.hflip=1.5", "aug.hflip=1.5: expected a number >= 0 and <= 1"),
        ("aug.smoothing=1", "aug.smoothing=1: expected a number >= 0 and < 1"),
        ("aug.mixup_mode=rows", "aug.mixup_mode='rows': expected one of batch, pair, elem"),
        ("epochs=abc", "epochs='abc': expected an integer >= 1"),
        ("epochs=2.5", "epochs=2.5: expected an integer >= 1"),
        ("lr=0", "lr=0: expected a number > 0"),
        ("lr=true", "lr=True: expected a number > 0"),
        ("data.img_size=[3,4]", "data.img_size=[3, 4]: expected an integer >= 1"),
        ("logger.wandb.tags=[1]", "logger.wandb.tags=[1]: expected a list of strings"),
        ("model.kwargs=3", "model.kwargs=3: expected a mapping"),
        (
            "+model.bogus=1",
            "model.bogus: not a key of this config (known here: attention_kernel, attention_memory_mb, convert",
        ),
        ("~throughput.iters", "throughput.iters: missing from the config"),
        ("amp=3", "amp=3: expected a section of keys (mixed precision)"),
        ("name=${nowhere}", "Interpolation key 'nowhere' not found"),
    ],
)
def test_cls_schema_names_the_problem(override, problem):
    problems = schema_problems(compose_config("cls", override), ClsConfig)
    assert len(problems) == 1 and problems[0].startswith(problem), problems


@pytest.mark.parametrize(
    ("task", "override", "problem"),
    [
        ("det", "model.backbone.drop_path_rate=2", "model.backbone.drop_path_rate=2: expected a number >= 0"),
        (
            "det",
            "model.backbone.lean_attention=maybe",
            "model.backbone.lean_attention='maybe': expected one of auto, True, False",
        ),
        (
            "det",
            "model.backbone.out_indices=[0,-1]",
            "model.backbone.out_indices=[0, -1]: expected a list of integers >= 0",
        ),
        (
            "det",
            "schedule.optim.betas=[0.9,1.0]",
            "schedule.optim.betas=[0.9, 1.0]: expected a list of numbers >= 0 and < 1",
        ),
        ("seg", "tta=2", "tta=2: expected true or false"),
        ("seg", "schedule.poly_power=0", "schedule.poly_power=0: expected a number > 0"),
        ("seg", "save.keep_last=0", "save.keep_last=0: expected an integer >= 1"),
    ],
)
def test_mm_schema_names_the_problem(task, override, problem):
    problems = schema_problems(compose_config(task, override), SCHEMAS[task])
    assert len(problems) == 1 and problems[0].startswith(problem), problems


def test_every_problem_at_once():
    cfg = compose_config("cls", "epochs=0", "batch_size=0", "aug.reprob=2", "+foo=1")
    assert sorted(p.split(":")[0].split("=")[0] for p in schema_problems(cfg, ClsConfig)) == [
        "aug.reprob",
        "batch_size",
        "epochs",
        "foo",
    ]


@dataclass
class _Inner:
    size: list[int] = key("sizes", min=1)
    extra: dict[str, Any] = key("anything")


@dataclass
class _Outer:
    mode: Literal["a", "b"] = key("a choice")
    lean: Literal["auto", True, False] = key("a choice of a string or a boolean", required=False)
    rate: float | None = key("a rate", min=0, max=1, exclusive_max=True)
    only_sometimes: int = key("may be absent", min=0, required=False)
    inner: _Inner = section(_Inner, "nested")


@pytest.mark.parametrize(
    ("node", "problems"),
    [
        ({"mode": "a", "rate": None, "inner": {"size": [1, 2], "extra": {"x": [1]}}}, []),
        ({"mode": "a", "rate": 0.5, "only_sometimes": 3, "inner": {"size": [], "extra": {}}}, []),
        ({"mode": "b", "lean": False, "rate": 0, "inner": {"size": [1], "extra": {}}}, []),
        ({"mode": "b", "lean": 0, "rate": 0, "inner": {"size": [1], "extra": {}}}, ["lean=0"]),  # 0 is not False
        ({"mode": "b", "lean": "true", "rate": 0, "inner": {"size": [1], "extra": {}}}, ["lean='true'"]),
        ({"mode": "c", "rate": 1, "inner": {"size": [0], "extra": {}}}, ["mode='c'", "rate=1", "inner.size=[0]"]),
        (
            {"mode": "a", "rate": float("nan"), "inner": {"size": [True], "extra": []}},
            ["rate=nan", "inner.size=[True]", "inner.extra=[]"],
        ),
        (
            {"rate": 0, "only_sometimes": -1, "inner": {"extra": {}, "more": 1}},
            ["mode", "only_sometimes=-1", "inner.size", "inner.more"],
        ),
    ],
)
def test_checker_on_a_small_schema(node, problems):
    found = schema_problems(OmegaConf.create(node), _Outer)
    assert [p.split(":")[0] for p in found] == problems, found


def test_help_lists_documented_keys_with_their_values():
    text = schema_help(ClsConfig, compose_config("cls"))
    line = next(x for x in text.splitlines() if x.strip().startswith("schedule.sched:"))
    assert "one of cosine" in line and "updated every step" in line and "['cosine']" in line
    assert "data.train_split: a string" in text and "[not set in this config]" in text  # digits has no splits


def test_a_file_key_given_a_folder_names_the_checkpoints_in_it(tmp_path):
    """checkpoint= a run's folder (for the best.pth in it) is not 'no such file': both trainers say what is there."""
    from cat.errors import ConfigError
    from cat.runtime.resume import file_problem

    run = tmp_path / "run"
    run.mkdir()
    assert file_problem("checkpoint", str(run)) == f"checkpoint={run}: a folder, not a file"
    run_folder(run)
    for name in ("last.pth", "best.pth", "log.txt"):
        (run / name).write_bytes(b"")
    assert file_problem("checkpoint", str(run / "best.pth")) is None
    assert file_problem("checkpoint", str(tmp_path / "gone.pth")) == f"checkpoint={tmp_path / 'gone.pth'}: no such file"
    named = f"checkpoint={run}: a folder, not a file (it holds best.pth, last.pth: give one)"
    with pytest.raises(ConfigError) as refused:
        checked_config("cls", f"checkpoint={run}", f"output_dir={tmp_path / 'out'}")
    assert named in refused.value.problems
    # resume=false moves the folder's files aside before the run reads them: its own best.pth cannot start it.
    with pytest.raises(ConfigError) as refused:
        checked_config("cls", f"checkpoint={run / 'best.pth'}", f"output_dir={run}", "resume=false")
    assert refused.value.problems == [
        f"checkpoint={run / 'best.pth'}: made by the run in output_dir, whose files resume=false moves into "
        "earlier_runs/ before the run starts; copy it elsewhere first, or choose another output_dir"
    ]
    pytest.importorskip("mmseg", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")
    with pytest.raises(ConfigError) as refused:
        checked_config("seg", f"model.pretrained={run}", f"data.root={tmp_path}")
    assert f"model.pretrained={run}: a folder, not a file (it holds best.pth, last.pth: give one)" in (
        refused.value.problems
    )
