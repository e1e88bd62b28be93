"""What a classification run is built from: samplers, the model's arguments, resume rules."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch.utils.data import DistributedSampler

from cat.classification.data_loading import ResumableSampler, ShardSampler, num_classes_of
from cat.classification.model_building import build_model, model_differences
from cat.classification.schema import ClsConfig
from cat.errors import ConfigError
from cat.runtime.resume import check_resume
from cat.runtime.schema import FIXED, FREE, GROW, RECIPE, config_record, key_rule
from tests.conftest import TINY_CLS, typed_config


def _build(cfg: ClsConfig, num_classes: int, **kwargs):
    return build_model(cfg.model, num_classes, cfg.data.img_size, **kwargs)


def test_resumable_sampler_continues_the_epoch_where_it_stopped():
    base = DistributedSampler(range(20), num_replicas=2, rank=1, shuffle=True, seed=3, drop_last=True)
    sampler = ResumableSampler(base)
    sampler.set_epoch(4)
    whole = list(sampler)
    sampler.set_epoch(4, skip=6)
    assert list(sampler) == whole[6:] and len(sampler) == len(whole) - 6
    sampler.set_epoch(5)
    assert list(sampler) != whole  # another epoch, another order


def test_shard_sampler_covers_every_index_once():
    shards = [list(ShardSampler(11, rank, 3)) for rank in range(3)]
    assert sorted(sum(shards, [])) == list(range(11)) and [len(s) for s in shards] == [4, 4, 3]


def test_what_a_resume_may_change_is_declared_on_each_key():
    rules = {
        "data.img_size": FIXED,
        "data.root": FREE,  # the same data may move
        "model.kwargs.depth": FIXED,  # inside a mapping: the mapping's key decides
        "model.lean_attention": FREE,  # the same math, computed another way
        "optim.opt": FIXED,
        "optim.weight_decay": RECIPE,
        "lr": RECIPE,
        "ema.enabled": FIXED,
        "amp.enabled": RECIPE,
        "epochs": GROW,  # may grow, never below what the checkpoint trained
        "workers": FREE,
        "no.such.key": FREE,  # one a checkpoint recorded before it was removed
    }
    assert {path: key_rule(ClsConfig, path) for path in rules} == rules


def test_one_resume_rule_refuses_fixed_changes_and_returns_the_others():
    cfg = typed_config("cls", "data.img_size=64", "data.root=/y", "lr=2.0", "model.lean_attention=false")
    saved = config_record(typed_config("cls", "data.root=/x", "lr=1.0", "resume=false"))
    saved["data"]["img_size"] = 64
    changed = check_resume("last.pth", saved, cfg, None)  # resume itself says how the run was launched: left out
    assert changed == {"data.root": ["/x", "/y"], "lr": [1.0, 2.0], "model.lean_attention": ["auto", False]}
    saved["data"]["img_size"] = 32
    with pytest.raises(ConfigError) as refused:
        check_resume("last.pth", saved, cfg, None, ["world size 2 -> 4 (mid-epoch)"])
    assert refused.value.problems == [
        "cannot resume last.pth with a different data.img_size: 32 -> 64",
        "cannot resume last.pth with a different world size 2 -> 4 (mid-epoch)",
        "start a new run in another output_dir, or pass resume=false, which starts the folder over and keeps its "
        "earlier run in earlier_runs/",
    ]


@pytest.mark.parametrize(("model", "takes_img_size"), [("ca_deit_tiny", True), ("resnet18", False)])
def test_build_model_passes_img_size_only_to_models_that_take_it(model, takes_img_size):
    cfg = typed_config(
        "cls", "experiment=deit_t", f"model.name={model}", "data.img_size=32", "model.drop_path_rate=0.2"
    )
    with torch.device("meta"):
        built = build_model(cfg.model, num_classes=3, img_size=32)
    assert built.num_classes == 3
    if takes_img_size:
        assert built.patch_embed.img_size == (32, 32) and built.blocks[-1].drop_path1.drop_prob == pytest.approx(0.2)


def test_a_recorded_model_is_read_with_the_values_of_runs_before_its_keys():
    model = typed_config("cls", *TINY_CLS).model
    # A run recorded before `kwargs` and `convert` existed had none of either: the same model as one that sets none.
    assert model_differences({"model": {"name": model.name}}, dataclasses.replace(model, kwargs={})) == []
    assert model_differences({"model": {"name": model.name}}, dataclasses.replace(model, kwargs={}, convert={})) == [
        "model.convert=None where this model has {}"
    ]
    assert model_differences(None, model) == []  # a file that records no run: nothing to compare


def test_num_classes_from_the_config_or_the_folders():
    class Folders:
        classes = ["a", "b", "c"]

    assert num_classes_of(typed_config("cls", *TINY_CLS), Folders()) == 4  # synthetic: data.num_classes
    assert num_classes_of(typed_config("cls", "data=folder"), Folders()) == 3


def test_fine_tuning_starts_a_classifier_for_another_class_count_fresh(tmp_path, caplog):
    """checkpoint= in train mode: the body loads, a classifier for another class count does not (the
    authors' --finetune); anything else that does not match still refuses, and eval loads strictly."""
    from cat.models import CheckpointMismatchError

    cfg = typed_config("cls", *TINY_CLS)
    source = _build(cfg, 7)
    path = tmp_path / "seven_classes.pth"
    torch.save({"model": source.state_dict()}, path)
    with caplog.at_level("INFO"):
        model = _build(cfg, 5, checkpoint=str(path), fine_tune=True)
    assert "classifier 'head' not loaded (another class count: head.weight (7, 16), head.bias (7,))" in caplog.text
    torch.testing.assert_close(model.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)
    assert model.head.weight.shape == (5, 16)
    with pytest.raises(CheckpointMismatchError, match="head.weight: model"):
        _build(cfg, 5, checkpoint=str(path))
    deeper = typed_config("cls", *TINY_CLS, "model.kwargs.depth=2")
    with pytest.raises(CheckpointMismatchError, match=r"missing in checkpoint \(15\): blocks.1"):
        _build(deeper, 5, checkpoint=str(path), fine_tune=True)
    from cat.models.loading import load_for_fine_tuning

    fresh = _build(deeper, 5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointMismatchError):
        load_for_fine_tuning(fresh, source.state_dict())
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # a refusal loads nothing


def test_checkpoint_ema_starts_from_the_weight_ema(tmp_path):
    """checkpoint_ema=true loads the file's model_ema, not its model weights; a file without one is refused,
    naming it."""
    from cat.errors import CheckpointError

    cfg = typed_config("cls", *TINY_CLS)
    weights, ema = _build(cfg, 4).state_dict(), _build(cfg, 4).state_dict()
    path = tmp_path / "with_ema.pth"
    torch.save({"model": weights, "model_ema": ema}, path)
    from_ema = _build(cfg, 4, checkpoint=str(path), use_ema=True)
    from_model = _build(cfg, 4, checkpoint=str(path))
    for key, value in from_ema.state_dict().items():
        torch.testing.assert_close(value, ema[key])
        torch.testing.assert_close(from_model.state_dict()[key], weights[key])
    assert not torch.equal(ema["head.weight"], weights["head.weight"])
    torch.save({"model": weights}, tmp_path / "without.pth")
    with pytest.raises(CheckpointError, match=r"without.pth holds no weight EMA"):
        _build(cfg, 4, checkpoint=str(tmp_path / "without.pth"), use_ema=True)
