"""Bad inputs to train_cls.py, table-driven: each ends the run with one line (``error: ...``), exit
status 2 and no traceback (``debug=true`` brings it back), and leaves every file it found as it was.

The table's runs share one interpreter (``tests.entry_cases``); the tests below it are subprocesses."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests import prewarmed
from tests.conftest import OFFICIAL_CA_DEIT, REPO, TINY_CLS, refusal_line, run_folder
from tests.entry_cases import run_entry_cases
from tests.subprocess_output import output_tail

pytestmark = pytest.mark.slow  # end-to-end runs: `pytest -m "not slow"` leaves them out

TINY = [*TINY_CLS, "epochs=1"]
# Files a refused run may add to the folder it was pointed at, or to its eval/ subfolder: its log, its
# command line and the marker that the folder is a run's.
RUN_RECORD = {"log.txt", "overrides.yaml", ".cat-run", ".cat-made"}


def _write(name: str, content: bytes | str) -> Callable[[Path], list[str]]:
    def setup(out: Path) -> list[str]:
        run_folder(out)
        data = content.encode() if isinstance(content, str) else content
        (out / name).write_bytes(data)
        return []

    return setup


def _foreign(out: Path) -> list[str]:
    """A folder of the user's, not a run's: refused, nothing in it touched."""
    out.mkdir(parents=True)
    (out / "thesis.tex").write_text("mine")
    return []


def _mode_folders_deep(out: Path) -> list[str]:
    """eval/eval/... 400 deep, a config.yaml at the bottom: no run's folder (its check ran out of stack)."""
    deepest = out.joinpath(*["eval"] * 400)
    deepest.mkdir(parents=True)
    (deepest / "config.yaml").write_text("x: 1\n")
    return []


def _lock_link(out: Path) -> list[str]:
    run_folder(out)
    (out / ".lock").symlink_to(out / "gone")
    return []


def _lock_folder(out: Path) -> list[str]:
    (run_folder(out) / ".lock").mkdir()
    return []


def _dangling_output(out: Path) -> list[str]:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.symlink_to(out.parent / "nowhere")
    return []


def _last(payload: Callable[[], object]) -> Callable[[Path], list[str]]:
    def setup(out: Path) -> list[str]:
        run_folder(out)
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(50_000)  # pickling a 5,000-deep config recurses
        try:
            torch.save(payload(), out / "last.pth")
        finally:
            sys.setrecursionlimit(limit)
        return []

    return setup


def _release_last(out: Path) -> list[str]:
    if not (OFFICIAL_CA_DEIT / "small_p8_64.pth").is_file():
        pytest.skip("../shared/fixtures/official_ca_deit is not present")
    run_folder(out)
    (out / "last.pth").write_bytes((OFFICIAL_CA_DEIT / "small_p8_64.pth").read_bytes())
    return []


def _deep(depth: int) -> dict:
    node: dict = {}
    root = node
    for _ in range(depth):
        node["x"] = {}
        node = node["x"]
    return root


def _training_entries(**extra: object) -> dict:
    return {"model": {}, "optimizer": {}, "scheduler": {}, "epoch": 0, "step_in_epoch": 0, "config": {}, **extra}


def _checkpoint_list(out: Path) -> list[str]:
    run_folder(out)
    torch.save([1, 2, 3], out / "list.pth")
    return ["mode=eval", f"checkpoint={out / 'list.pth'}"]


def _checkpoint_without_ema(out: Path) -> list[str]:
    run_folder(out)
    torch.save({"model": {"w": torch.zeros(2)}}, out / "without_ema.pth")
    return [f"checkpoint={out / 'without_ema.pth'}", "checkpoint_ema=true"]


def _finished(metrics: bytes, config: bytes) -> Callable[[Path], list[str]]:
    def setup(out: Path) -> list[str]:
        run_folder(out)
        (out / "metrics.json").write_bytes(metrics)
        (out / "config.yaml").write_bytes(config)
        return []

    return setup


def _zip_root_without_zips(out: Path) -> list[str]:
    (out.parent / "packed").mkdir(parents=True)
    return ["data=folder", "data.format=zip", f"data.root={out.parent / 'packed'}", "data.num_classes=null"]


def _overrides(*overrides: str) -> Callable[[Path], list[str]]:
    return lambda out: list(overrides)


def _unreadable_link_output(out: Path) -> list[str]:
    """output_dir through a link only its owner may read: init's working directory under /proc."""
    try:
        os.readlink("/proc/1/cwd")
    except PermissionError:
        return ["output_dir=/proc/1/cwd"]
    pytest.skip("/proc/1/cwd can be read here (init is this user's, or ptrace is allowed)")


def _with(setup: Callable[[Path], list[str]], *overrides: str) -> Callable[[Path], list[str]]:
    return lambda out: [*setup(out), *overrides]


def _started_over_folder(out: Path) -> list[str]:
    (run_folder(out) / ".started_over").mkdir()
    return []


CASES = {
    # values that passed the schema, then crashed or hung the run (issue 65, item 6)
    "epochs_huge": (
        _overrides("epochs=10000000000000000"),
        "epochs=10000000000000000: expected an integer >= 1 and <=",
    ),
    "seed_huge": (_overrides("seed=100000000000000000000"), "seed=100000000000000000000: expected an integer >= 0 and"),
    "lr_huge": (_overrides("lr=1e308"), "lr=1e+308: expected a number > 0 and <= 1e+06"),
    "crop_pct_tiny": (_overrides("data=imagenet", "data.crop_pct=1e-300"), "data.crop_pct=1e-300: expected a number"),
    "mean_two": (
        _overrides("data=imagenet", "data.root=/usr", "data.mean=[0.5,0.5]"),
        "data.mean=[0.5, 0.5]: expected 3 numbers, one per RGB channel",
    ),
    "experiment_null": (_overrides("experiment=null"), "experiment=null: experiment is a config group, whose value"),
    "mean_of_synthetic": (
        _overrides("data=synthetic", "data.mean=[0.5,0.5,0.5]"),
        "data.mean: the data option chosen does not set it (its config has no such key: other data options use it)",
    ),
    "mean_empty": (_overrides("data=imagenet", "data.root=/usr", "data.mean=[]"), "data.mean=[]: expected 3 numbers"),
    "dist_timeout_huge": (_overrides("dist_timeout_s=100000000000000000000"), "dist_timeout_s=100000000000000000000"),
    "train_split_is_val": (
        _overrides("data=imagenet", "data.root=/usr", "data.train_split=val"),
        "data.train_split=val is data.val_split too: the run would train on the images it validates on",
    ),
    "name_help_resolver": (_overrides("name=${cat_keys:train_cls}"), "characters): expected a string of 1 to 255"),
    "name_empty": (_overrides("name="), "name='': expected a string of 1 to 255 characters"),
    "output_dir_unreadable_link": (_unreadable_link_output, "cannot follow a link on its path (Permission denied"),
    "output_dir_empty": (_overrides("output_dir="), "output_dir is empty (an unset shell variable?)"),
    "output_dir_mode_folders_deep": (_mode_folders_deep, "holds files that are not a cat run's (1 entry, e.g. eval)"),
    "output_dir_foreign": (_foreign, "holds files that are not a cat run's (1 entry, e.g. thesis.tex); choose an"),
    # the profiler window (a list the schema types; its shape and order are checked after)
    "profile_steps_one": (_overrides("profile.steps=[5]"), "profile.steps=[5]: expected [first, last]"),
    "profile_steps_reversed": (_overrides("profile.steps=[9,3]"), "profile.steps=[9, 3]: expected [first, last]"),
    "profile_steps_zero": (_overrides("profile.steps=[0,3]"), "profile.steps"),
    "profile_steps_text": (_overrides("profile.steps=[a,b]"), "profile.steps"),
    "profile_in_eval": (_overrides("mode=eval", "profile.steps=[1,2]"), "only training is profiled"),
    "profile_top_zero": (_overrides("profile.top=0"), "profile.top=0: expected an integer >= 1"),
    # the opt-in decoding keys of image-file datasets
    "decode_draft_text": (
        _overrides("data=imagenet", "data.decode_draft=maybe"),
        "data.decode_draft='maybe': expected true or false",
    ),
    "normalize_on_device_number": (
        _overrides("data=imagenet", "data.normalize_on_device=2"),
        "data.normalize_on_device=2: expected true or false",
    ),
    "auto_augment_layers_huge": (
        _overrides("data=imagenet", "data.root=/usr", "aug.auto_augment=rand-m9999-n9999"),
        "aug.auto_augment='rand-m9999-n9999': n9999: expected n from 1 to 15",
    ),
    "augmix_width_huge": (
        _overrides("data=imagenet", "data.root=/usr", "aug.auto_augment=augmix-m5-w400"),
        "aug.auto_augment='augmix-m5-w400': w400: expected w from 1 to 16",
    ),
    # the folder's lock
    "lock_list": (_write(".lock", "[]"), "holds '[]', not cat's lock record"),
    "lock_string": (_write(".lock", '"str"'), "not cat's lock record"),
    "lock_pid_text": (_write(".lock", '{"pid": "abc"}'), "not cat's lock record"),
    "lock_pid_huge": (_write(".lock", '{"pid": 1e30}'), "not cat's lock record"),
    "lock_pid_null": (_write(".lock", '{"pid": null}'), "not cat's lock record"),
    "lock_nested_deep": (_write(".lock", "[" * 5000 + "]" * 5000), "holds '[[[["),
    "marker_nested_deep": (_write(".cat-run", "[" * 5000 + "]" * 5000), ".cat-run is not cat's run marker"),
    "lock_dangling_link": (_lock_link, ".lock is a symbolic link, not a regular file"),
    "lock_folder": (_lock_folder, ".lock is a folder, not a regular file"),
    "output_dir_dangling_link": (_dangling_output, "a symbolic link to"),
    # what a resume reads
    "last_list": (_last(lambda: [1, 2]), "holds a list, not a training checkpoint"),
    "last_bare_state_dict": (_last(lambda: {"w": torch.zeros(2)}), "is a bare state dict, not a training checkpoint"),
    "last_release_file": (_release_last, "is weights only, not a training checkpoint"),
    "last_negative_epoch": (_last(lambda: _training_entries(epoch=-5)), "epoch=-5, step_in_epoch=0: not the position"),
    "last_step_past_the_epoch": (
        _last(lambda: _training_entries(step_in_epoch=10**6)),
        "step_in_epoch=1000000 is past this run's",
    ),
    "last_deep_config": (_last(lambda: _training_entries(config=_deep(5000))), "nested over 32 levels"),
    "checkpoint_list": (_checkpoint_list, "holds a list, not a checkpoint"),
    "checkpoint_without_ema": (_checkpoint_without_ema, "without_ema.pth holds no weight EMA (no model_ema"),
    "finished_metrics_list": (_finished(b"[]", b"x: 1\n"), "damaged run record (ValueError: a JSON list"),
    "finished_config_not_utf8": (_finished(b"{}", b"\xff\xfe\x00bad"), "damaged run record (UnicodeDecodeError"),
    "wandb_run_id": (_write("wandb_run_id.txt", "../../x; rm -rf ~"), "not a W&B run id"),
    # what a run started over (resume=false) reads: which launch started it over
    "started_over_list": (_with(_write(".started_over", "[]"), "resume=false"), ".started_over is not cat's record"),
    "started_over_types": (
        _with(_write(".started_over", '{"slurm_job_id": 7, "slurm_restarts": "1"}'), "resume=false"),
        "is not cat's record of the launch that started this run over (resume=false); remove it, or pass resume=true",
    ),
    "started_over_nested_deep": (
        _with(_write(".started_over", "[" * 5000 + "]" * 5000), "resume=false"),
        ".started_over is not cat's record",
    ),
    "started_over_folder": (_with(_started_over_folder, "resume=false"), ".started_over is not cat's record"),
    # config values
    "sched_bogus": (_overrides("schedule.sched=bogus"), "schedule.sched='bogus': expected one of cosine"),
    "optim_kwarg": (_overrides("++optim.kwargs.foo=1"), "optim.kwargs.foo: not an argument of adamw (accepted:"),
    "drop_path_5": (_overrides("model.drop_path_rate=5"), "model.drop_path_rate=5: expected a number >= 0 and <= 1"),
    "drop_path_negative": (_overrides("model.drop_path_rate=-1"), "model.drop_path_rate=-1"),
    "depth_negative": (_overrides("++model.kwargs.depth=-2"), "model.kwargs.depth=-2: sizes the network"),
    "model_kwarg_unknown": (
        _overrides("++model.kwargs.foo=1"),
        "model.kwargs.foo: not an argument of ca_deit_tiny (accepted: cache_dir, checkpoint_path, depth,",
    ),
    "lean_attention_maybe": (
        _overrides("model.lean_attention=maybe"),
        "model.lean_attention='maybe': expected one of auto, True, False",
    ),
    "fft_backend_cufft": (
        _overrides("model.fft_backend=cufft"),
        "model.fft_backend='cufft': expected one of auto, fft, separable, matmul",
    ),
    "attention_kernel_cuda": (
        _overrides("model.attention_kernel=cuda"),
        "model.attention_kernel='cuda': expected one of auto, triton, aten",
    ),
    "attention_memory_zero": (
        _overrides("model.attention_memory_mb=0"),
        "model.attention_memory_mb=0: expected an integer >= 1",
    ),
    "attention_memory_321_digits": (  # was an OverflowError in cat.ops.policy.describe
        _overrides(f"model.attention_memory_mb={'9' * 321}"),
        "(321 characters): expected an integer >= 1 and <= 1.09951e+12",
    ),
    "integer_past_64_bits": (  # every integer key has bounds, its own or a 64-bit integer's
        _overrides(f"workers={'9' * 30}"),
        f"workers={'9' * 30}: expected an integer >= 0",
    ),
    "integer_of_5001_digits": (  # was a ValueError from Python's integer parsing, in the sweep-cell pre-check
        _overrides(f"epochs={'9' * 5001}"),
        "a value on the command line is not one a config holds: Exceeds the limit (4300 digits)",
    ),
    "compile_mode_fast": (
        _overrides("compile_mode=fast"),
        "compile_mode='fast': expected one of auto, default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs",
    ),
    "compile_sometimes": (_overrides("compile=sometimes"), "compile='sometimes': expected one of auto, True, False"),
    "amp_enabled_maybe": (_overrides("amp.enabled=maybe"), "amp.enabled='maybe': expected one of auto, True, False"),
    "amp_dtype_fp8": (_overrides("amp.dtype=fp8"), "amp.dtype='fp8': expected one of auto, bf16, fp16"),
    "amp_tf32_maybe": (_overrides("amp.tf32=maybe"), "amp.tf32='maybe': expected"),
    "compile_fullgraph_maybe": (_overrides("compile_fullgraph=maybe"), "compile_fullgraph='maybe': expected"),
    "convert_unknown_key": (
        _overrides("model.convert={stage:[0]}"),
        "model.convert.stage: not an argument of cat.convert (blocks, stages, head_dim)",
    ),
    "convert_nothing_to_convert": (
        _overrides("model.convert={}"),
        "model.convert={}: nothing converted in CirculantVisionTransformer: no ViT/DeiT/EVA, Swin or PVT v2",
    ),
    "convert_head_dim": (
        _overrides("model.name=deit_tiny_patch16_224", "++model.kwargs.num_heads=4", "model.convert={head_dim:5}"),
        "model.convert={'head_dim': 5}: head_dim=5 must divide the attention width",
    ),
    "aug_mixup_mode": (_overrides("aug.mixup_mode=rows"), "aug.mixup_mode='rows': expected one of batch, pair, elem"),
    "aug_smoothing": (_overrides("aug.smoothing=1"), "aug.smoothing=1: expected a number >= 0 and < 1"),
    "checkpoint_ema_without_checkpoint": (
        _overrides("checkpoint_ema=true"),
        "checkpoint_ema=true takes a checkpoint's weight EMA: give checkpoint=PATH",
    ),
    "checkpoint_ema_in_eval": (
        _with(_checkpoint_list, "checkpoint_ema=true"),
        "checkpoint_ema=true: mode=eval evaluates the checkpoint's weights and their EMA both; drop it",
    ),
    "checkpoint_ema_not_bool": (_overrides("checkpoint_ema=maybe"), "checkpoint_ema='maybe': expected"),
    "accum_steps_zero": (_overrides("accum_steps=0"), "accum_steps=0: expected an integer >= 1"),
    "dist_timeout_zero": (_overrides("dist_timeout_s=0"), "dist_timeout_s=0: expected an integer >= 1"),
    "confine_not_bool": (_overrides("run.confine=maybe"), "run.confine='maybe': expected true or false"),
    "may_write_a_string": (
        _overrides("run.may_write=/scratch"),
        "run.may_write='/scratch': expected a list of strings",
    ),
    "may_write_numbers": (_overrides("run.may_write=[1]"), "run.may_write=[1]: expected a list of strings"),
    "wandb_group_list": (_overrides("logger.wandb.group=[a]"), "logger.wandb.group=['a']: expected a string (or null)"),
    "wandb_tag_long": (
        _overrides(f"logger.wandb.tags=[ok,{'t' * 65}]"),
        # W&B refuses it at init, or at the `wandb sync` of an offline run
        f"logger.wandb.tags=['ok', '{'t' * 65}']: expected a list of strings of 1 to 64 characters",
    ),
    "wandb_tag_empty": (_overrides("logger.wandb.tags=['']"), "expected a list of strings of 1 to 64 characters"),
    "wandb_project_long": (
        _overrides(f"logger.wandb.project={'p' * 129}"),
        "expected a string of 1 to 128 characters, none of /\\#?%:",
    ),
    "wandb_project_slash": (
        _overrides("logger.wandb.project=team/cat"),
        "logger.wandb.project='team/cat': expected a string of 1 to 128 characters, none of /\\#?%:",
    ),
    "grad_checkpointing_unsupported": (
        _overrides("model.name=convit_tiny", "model.grad_checkpointing=true"),
        "error: invalid config: model.grad_checkpointing=true: convit_tiny does not support it",
    ),
    "data_format_lmdb": (
        _overrides("data=folder", "data.format=lmdb"),
        "data.format='lmdb': expected one of folder, zip, tar",
    ),
    "cache_mode_on_a_folder": (
        _overrides("data=folder", "data.cache_mode=part"),
        "data.cache_mode=part: caches a zip (data.format=zip), not a folder",
    ),
    "tar_root_without_shards": (
        _overrides("data=folder", "data.format=tar", f"data.root={REPO / 'configs'}", "data.num_classes=null"),
        "no train-*.tar shards in",
    ),
    "cache_mode_unknown": (
        _overrides("data=folder", "data.cache_mode=some"),
        "data.cache_mode='some': expected one of no, part, full",
    ),
    "shuffle_buffer_zero": (
        _overrides("data=folder", "data.format=tar", "data.shuffle_buffer=0"),
        "data.shuffle_buffer=0: expected an integer >= 1",
    ),
    "max_image_mb_zero": (
        _overrides("data=folder", "data.max_image_mb=0"),
        "data.max_image_mb=0: expected a number > 0",
    ),
    "max_image_mb_nan": (
        _overrides("data=folder", "data.max_image_mb=nan"),
        "data.max_image_mb=nan: expected a number > 0",
    ),
    "zip_root_without_zips": (_zip_root_without_zips, "train.zip (data.format=zip reads <root>/<split>.zip"),
    "unknown_key": (_overrides("+bogus=1"), "bogus: not a key of this config (known here: accum_steps, amp, aug,"),
    # Hydra's own refusals of the command line, before the schema sees a config
    "unknown_key_without_plus": (_overrides("bogus=1"), "bogus: not a key of this config (known here: accum_steps,"),
    "unknown_nested_key": (_overrides("optim.lrr=1"), "optim.lrr: not a key of this config (known here: clip_grad,"),
    "unknown_kwarg_without_plus": (
        _overrides("model.kwargs.dept=3"),
        "model.kwargs.dept: model.kwargs has no such entry; to add one: +model.kwargs.dept=3",
    ),
    "key_under_a_value": (_overrides("optim.opt.x=1"), "optim.opt.x: optim.opt is a single value, not a section"),
    "unknown_group_option": (
        _overrides("model=ca_deit_tiy"),
        "model=ca_deit_tiy: no such option (available: ca_deit_base,",
    ),
    "unparsable_override": (_overrides("lr=[1,2"), "lr=[1,2: not an override Hydra can parse (no viable alternative"),
    "append_existing_key": (_overrides("+epochs=3"), "An item is already at 'epochs'. Either remove + prefix"),
    "img_size_huge": (_overrides("data.img_size=100000"), "one batch of input images alone takes"),
}


def _snapshot(folder: Path) -> dict[str, str]:
    if not folder.is_dir() or folder.is_symlink():
        return {}
    return {
        str(p.relative_to(folder)): "<dir>" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in folder.rglob("*")
        if not p.is_symlink()
    }


def _args(out: Path, overrides: list[str]) -> list[str]:
    wandb = ["logger.wandb.mode=offline"] if (out / "wandb_run_id.txt").exists() else []
    return [*TINY, f"output_dir={out}", *overrides, *wandb]


def _run(out: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    return prewarmed.run(
        [sys.executable, str(REPO / "train_cls.py"), *_args(out, overrides)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "WANDB_SILENT": "true"},
    )


@pytest.fixture(scope="module")
def refused(tmp_path_factory) -> dict[str, tuple[Path, dict[str, str], subprocess.CompletedProcess | str]]:
    """Every case of the table, set up in its own folder, then run: ``{case: (folder, the folder's
    files before the run, the run, or why the case cannot be set up here)}``."""
    root = tmp_path_factory.mktemp("refused")
    cases, setups = {}, {}
    for name, (setup, _) in CASES.items():
        out = root / name / "run"
        try:
            overrides = setup(out)
        except pytest.skip.Exception as skip:
            setups[name] = (out, {}, str(skip))
            continue
        setups[name] = (out, _snapshot(out), "")
        cases[name] = _args(out, overrides)
    runs = run_entry_cases("train_cls.py", cases, env={"WANDB_SILENT": "true"})
    return {name: (out, before, runs.get(name, skipped)) for name, (out, before, skipped) in setups.items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_line(case, refused):
    out, before, run = refused[case]
    if isinstance(run, str):
        pytest.skip(run)
    last = refusal_line(run)
    assert CASES[case][1] in last, last
    after = _snapshot(out)
    added = {k for k in after.keys() - before.keys() if Path(k).name in RUN_RECORD or after[k] == "<dir>"}
    assert {k: v for k, v in after.items() if k not in added} == before


def test_debug_keeps_the_traceback(tmp_path):
    proc = _run(tmp_path / "run", ["schedule.sched=bogus", "debug=true"])
    assert proc.returncode != 0 and "Traceback" in proc.stderr and "schedule.sched='bogus'" in proc.stderr


def test_hydra_full_error_keeps_hydras_exception(tmp_path):
    """HYDRA_FULL_ERROR=1 asks for Hydra's own exception, for a refused command line too."""
    proc = prewarmed.run(
        [sys.executable, str(REPO / "train_cls.py"), "bogus=1"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "HYDRA_FULL_ERROR": "1"},
    )
    assert proc.returncode == 1 and "hydra.errors.ConfigCompositionException" in proc.stderr, proc.stderr[-3000:]


def test_folder_named_like_a_temporary_is_left_alone(tmp_path):
    out = tmp_path / "run"
    (run_folder(out) / ".x.tmp").mkdir()
    (out / ".x.tmp" / "keep").write_text("mine")
    proc = _run(out, [])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (out / ".x.tmp" / "keep").read_text() == "mine" and (out / "metrics.json").is_file()


def test_refused_resume_leaves_the_record(tmp_path):
    """A resume with a change that diverges: nothing in the record claims the change ran."""
    out = tmp_path / "run"
    proc = _run(out, [])
    assert proc.returncode == 0, output_tail(proc)
    before = _snapshot(out)
    proc = _run(out, ["lr=1e6", "epochs=4", "schedule.warmup_epochs=0"])
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "non-finite" in last and "the last good checkpoint) is kept" in last, last
    after = _snapshot(out)
    assert after.pop("log.txt") != before.pop("log.txt")
    after.pop("overrides.yaml"), before.pop("overrides.yaml")
    assert after == before and not (out / "config_changes.jsonl").exists()


def test_diverging_fresh_run_does_not_claim_a_good_checkpoint(tmp_path):
    out = tmp_path / "run"
    proc = _run(out, [])
    assert proc.returncode == 0, output_tail(proc)
    proc = _run(out, ["lr=1e6", "resume=false", "schedule.warmup_epochs=0"])
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "non-finite" in last and last.endswith("this run saved no checkpoint"), last
    # The earlier run, set aside when this one started the folder over, is whole.
    (earlier,) = (out / "earlier_runs").iterdir()
    assert (earlier / "last.pth").is_file() and (earlier / "metrics.json").is_file() and not (out / "last.pth").exists()


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (root only: CI runs as root; elsewhere the test skips)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)]).returncode:
        pytest.skip("needs root to mount a small tmpfs")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_full_disk_while_saving_is_one_line_and_keeps_last(small_disk):
    out = small_disk / "run"
    proc = _run(out, [])
    assert proc.returncode == 0, output_tail(proc)
    kept = hashlib.sha256((out / "last.pth").read_bytes()).hexdigest()
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    (small_disk / "filler").write_bytes(b"\0" * (free - 8192))  # room for the log, not for a checkpoint
    last = refusal_line(_run(out, ["epochs=2"]))
    assert f"cannot write {out / 'last.pth'}: no space left on the device" in last, last
    assert "the previous file is unchanged" in last
    assert hashlib.sha256((out / "last.pth").read_bytes()).hexdigest() == kept
