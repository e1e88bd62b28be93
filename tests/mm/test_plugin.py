"""``import cat.mm`` as a config's custom_imports line: what it registers, the portable checkpoint format, the
metric backend and saved config the stock tools build, and the FLOP handles of mmengine's analysis."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import cat
from cat.flops import count_macs
from cat.runtime.dist import DistEnv
from tests.conftest import compose_config, mm_builder

pytest.importorskip("mmdet", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")
pytest.importorskip("mmseg", reason="OpenMMLab stack not installed (bash scripts/setup_env.sh --mm)")

from mmengine.logging import HistoryBuffer  # noqa: E402  (after the skip: needs the stack)

# Everything a saved config of cat's names, by the registry it is looked up in.
REGISTERED = {
    "mmdet.registry.MODELS": ["TimmBackbone"],
    "mmseg.registry.MODELS": ["TimmBackbone"],
    "mmengine.registry.HOOKS": ["PreemptionHook", "PortableCheckpointHook"],
    "mmengine.registry.LOOPS": ["ResumableEpochBasedTrainLoop", "ResumableIterBasedTrainLoop"],
    "mmengine.registry.DATA_SAMPLERS": ["ResumableDefaultSampler", "ResumableInfiniteSampler"],
    "mmengine.registry.VISBACKENDS": ["MetricSinkBackend"],
}


def test_importing_cat_mm_alone_registers_everything_a_saved_config_names():
    """In a fresh interpreter (nothing imported, no call): each name in its registry, the atomic file backend and the
    counting handles; mmengine's checkpoint loaders stay its own (cat's runs install cat's loading themselves)."""
    code = f"""
import importlib, json
import cat.mm
from mmengine.analysis import complexity_analysis
from mmengine.fileio.backends import backends
from mmengine.runner.checkpoint import CheckpointLoader
found = {{}}
for path, names in {REGISTERED!r}.items():
    module, _, attr = path.rpartition(".")
    registry = getattr(importlib.import_module(module), attr)
    found[path] = [name for name in names if registry.get(name) is not None and name in registry.module_dict]
print(json.dumps({{
    "found": found,
    "backend": "cat_atomic_local" in backends,
    "loaders": sorted({{loader.__name__ for loader in CheckpointLoader._schemes.values()}}),
    "handles": sorted(k for k in complexity_analysis._DEFAULT_SUPPORTED_FLOP_OPS if k.endswith("_attention")),
}}))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["found"] == REGISTERED and result["backend"]
    assert not {"load_from_safe_local", "load_from_safe_remote", "refuse"} & set(result["loaders"])
    assert result["handles"] == ["aten::scaled_dot_product_attention", "cat::circulant_attention"]


# In a fresh interpreter: the stock stack's imports, then (or not) cat.mm's; what torch's weights-only allow-list
# holds (by name), the environment's names, and what stock mmengine's loader does with a checkpoint whose meta holds
# an argparse.Namespace (refused by torch's weights-only reader).
_STOCK_STATE = """
import json, os, sys, torch
import torchvision, timm, mmengine.runner, mmdet.apis, mmseg.apis, mmcv.ops
if sys.argv[2] == "cat":
    import cat.mm
from mmengine.runner.checkpoint import CheckpointLoader
try:
    CheckpointLoader.load_checkpoint(sys.argv[1])
    namespace = "loaded"
except Exception as error:
    namespace = type(error).__name__
allowed = sorted(str(g) if isinstance(g, tuple) else f"{g.__module__}.{g.__qualname__}"
                 for g in torch.serialization.get_safe_globals())
print(json.dumps({"allowed": allowed, "environ": sorted(os.environ), "namespace": namespace}))
"""


def test_importing_cat_mm_adds_names_and_changes_nothing_else(tmp_path):
    """torch's allow-list grows (73 to 83) and TORCHINDUCTOR_CACHE_DIR appears with torch._dynamo, which torchvision
    and timm import: the stack's own imports do that. cat.mm changes neither, nor what mmengine's loader refuses."""
    checkpoint = tmp_path / "namespace.pth"
    torch.save({"state_dict": {"w": torch.zeros(2)}, "meta": {"args": argparse.Namespace(lr=0.1)}}, checkpoint)
    states = {}
    for imports in ("stock", "cat"):
        proc = subprocess.run(
            [sys.executable, "-c", _STOCK_STATE, str(checkpoint), imports], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        states[imports] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert states["cat"] == states["stock"]
    assert states["stock"]["namespace"] == "UnpicklingError"


def test_registration_is_idempotent():
    from mmdet.registry import MODELS
    from mmengine.runner.checkpoint import CheckpointLoader

    from cat.mm.plugin import register

    def state() -> tuple:
        return MODELS.get("TimmBackbone"), {prefix: f.__name__ for prefix, f in CheckpointLoader._schemes.items()}

    before = state()
    register()
    register()
    assert state() == before


def test_the_message_hub_is_written_as_plain_data_and_read_back_as_buffers():
    from cat.mm.portable import plain_message_hub, restore_message_hub

    buffer = HistoryBuffer([0.5, 0.25], [1, 2], max_length=10)
    hub = {
        "log_scalars": {"train/loss": buffer},
        "runtime_info": {"eta": np.float64(3.0), "iter": 4},
        "resumed_keys": {},
    }
    plain = plain_message_hub(hub)
    assert plain["log_scalars"]["train/loss"] == {"log_history": [0.5, 0.25], "count_history": [1, 2], "max_length": 10}
    assert type(plain["runtime_info"]["eta"]) is float and hub["log_scalars"]["train/loss"] is buffer  # not mutated
    restored = restore_message_hub(plain)["log_scalars"]["train/loss"]
    assert isinstance(restored, HistoryBuffer) and restored.mean() == buffer.mean() and restored.max_length == 10
    # What is not such a buffer is dropped, as mmengine drops what is not a HistoryBuffer.
    hostile = {
        "extra_key": {"log_history": [1.0], "count_history": [1], "max_length": 5, "x": 1},
        "strings": {"log_history": ["1"], "count_history": [1], "max_length": 5},
        "booleans": {"log_history": [True], "count_history": [1], "max_length": 5},
        "lengths": {"log_history": [1.0, 2.0], "count_history": [1], "max_length": 5},
        "zero_length": {"log_history": [], "count_history": [], "max_length": 0},
        "float_length": {"log_history": [], "count_history": [], "max_length": 5.0},
    }
    assert restore_message_hub({"log_scalars": dict(hostile)})["log_scalars"] == {}


def test_a_checkpoint_with_the_portable_hook_loads_in_torch_weights_only(tmp_path):
    """The hook's checkpoint holds no object torch's weights-only loader refuses; without it, mmengine's does."""
    from cat.mm.portable import PortableCheckpointHook

    hub = {
        "log_scalars": {"loss": HistoryBuffer([1.0], [1])},
        "runtime_info": {"eta": np.float32(1)},
        "resumed_keys": {},
    }
    checkpoint = {"meta": {"epoch": 1}, "state_dict": {"w": torch.zeros(2)}, "message_hub": hub}
    torch.save(checkpoint, tmp_path / "stock.pth")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "stock.pth")
    PortableCheckpointHook().before_save_checkpoint(None, checkpoint)
    torch.save(checkpoint, tmp_path / "portable.pth")
    assert torch.serialization.get_unsafe_globals_in_checkpoint(tmp_path / "portable.pth") == []
    assert torch.load(tmp_path / "portable.pth")["message_hub"]["log_scalars"]["loss"]["log_history"] == [1.0]


def test_the_metric_backend_outside_a_cat_run_writes_into_the_tools_folder(tmp_path):
    from cat.mm.metric_sink import MetricSinkBackend

    backend = MetricSinkBackend(save_dir=str(tmp_path / "vis_data"))
    backend.add_scalars({"loss": 0.5, "note": "text", "lr": np.float32(0.25)}, step=3)
    backend.close()
    (line,) = (tmp_path / "vis_data" / "metrics.jsonl").read_text().splitlines()
    entry = json.loads(line)
    assert entry["step"] == 3 and entry["loss"] == 0.5 and entry["lr"] == 0.25 and "note" not in entry
    bare = MetricSinkBackend()  # as a stock tool's Visualizer builds it to draw images (mmseg's browse_dataset.py)
    bare.add_scalars({"note": "text"})  # no metric: nothing to write
    with pytest.raises(ValueError, match="no save_dir to write metrics.jsonl into"):
        bare.add_scalars({"loss": 0.5})
    bare.close()


def test_the_saved_config_is_portable_and_written_atomically(toy_coco, tmp_path):
    """mm_config.py: custom_imports, no work_dir, no auto-resume; a link planted at its name is refused, not
    written through."""
    from mmengine.config import Config

    from cat.errors import OutputError
    from cat.mm.config import RunnerConfig

    built = mm_builder("det")(compose_config("det", f"data.root={toy_coco}"), DistEnv(), str(tmp_path / "run"))
    assert built.work_dir == str(tmp_path / "run") and built.resume is True  # what the run itself uses
    target = tmp_path / "elsewhere.py"
    target.write_text("untouched\n")
    saved = tmp_path / "mm_config.py"
    os.symlink(target, saved)
    config = RunnerConfig(built.to_dict(), filename=str(saved))
    with pytest.raises(OutputError, match="mm_config.py is a symbolic link"):
        config.dump(str(saved))
    assert target.read_text() == "untouched\n"
    saved.unlink()
    config.dump(str(saved))
    dumped = Config.fromfile(str(saved))
    assert dumped.custom_imports == {"imports": ["cat.mm"], "allow_failed_imports": False}
    assert "work_dir" not in dumped and dumped.resume is False and dumped.model == built.model
    expected = {key: value for key, value in built.to_dict().items() if key not in ("work_dir", "resume")}
    assert {key: value for key, value in dumped.to_dict().items() if key != "resume"} == expected  # the rest as is


@pytest.mark.parametrize("name", ["ca_pvt_tiny", "ca_swin_tiny", "pvt_tiny", "deit_tiny_patch16_224"])
def test_mmengines_flop_analysis_counts_cat_models_as_count_macs_does(name):
    """mmengine's trace, with gradients on and the lean function forced (which the tracer cannot record),
    counts circulant attention and SDPA by cat's handles: within 1% of count_macs (mmengine also counts norms)."""
    from mmengine.analysis import get_model_complexity_info

    from cat.ops import set_lean_attention

    model = set_lean_attention(cat.create_model(name), True)
    x = torch.rand(1, 3, 224, 224)
    traced = get_model_complexity_info(model, inputs=(x,), show_table=False, show_arch=False)["flops"]
    assert traced == pytest.approx(count_macs(model, x), rel=0.01)
