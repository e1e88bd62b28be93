"""What a classification run is built from: samplers, the model's arguments, resume rules."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from cat.classification.builders import ResumableSampler, ShardSampler, build_model, num_classes_of
from cat.classification.trainer import RESUME_FIXED_KEYS, RESUME_FREE_KEYS
from cat.runtime.resume import resume_changes
from tests.conftest import TINY_CLS, compose_config


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


def test_resume_changes_fixed_and_free():
    saved = {"lr": 1.0, "model": {"name": "a", "lean_attention": True}, "data": {"root": "/x", "img_size": 32}}
    current = {"lr": 2.0, "model": {"name": "a", "lean_attention": False}, "data": {"root": "/y", "img_size": 64}}
    saved["resume"], current["resume"] = False, True  # how the run was launched (a requeue of resume=false)
    changed, fixed = resume_changes(saved, current, RESUME_FIXED_KEYS, RESUME_FREE_KEYS)
    assert changed == {
        "data.img_size": [32, 64],
        "data.root": ["/x", "/y"],
        "lr": [1.0, 2.0],
        "model.lean_attention": [True, False],
    }
    assert fixed == ["data.img_size"]


@pytest.mark.parametrize(("model", "takes_img_size"), [("ca_deit_tiny", True), ("resnet18", False)])
def test_build_model_passes_img_size_only_to_models_that_take_it(model, takes_img_size):
    cfg = compose_config(
        "cls", "experiment=deit_t", f"model.name={model}", "data.img_size=32", "model.drop_path_rate=0.2"
    )
    with torch.device("meta"):
        built = build_model(cfg, num_classes=3)
    assert built.num_classes == 3
    if takes_img_size:
        assert built.patch_embed.img_size == (32, 32) and built.blocks[-1].drop_path1.drop_prob == pytest.approx(0.2)


def test_num_classes_from_the_config_or_the_folders():
    class Folders:
        classes = ["a", "b", "c"]

    assert num_classes_of(compose_config("cls", *TINY_CLS), Folders()) == 4  # synthetic: data.num_classes
    assert num_classes_of(compose_config("cls", "data=folder"), Folders()) == 3


def test_fine_tuning_starts_a_classifier_for_another_class_count_fresh(tmp_path, caplog):
    """checkpoint= in train mode: the body loads, a classifier for another class count does not (the
    authors' --finetune); anything else that does not match still refuses, and eval loads strictly."""
    from cat.models import CheckpointMismatchError

    cfg = compose_config("cls", *TINY_CLS)
    source = build_model(cfg, 7)
    path = tmp_path / "seven_classes.pth"
    torch.save({"model": source.state_dict()}, path)
    with caplog.at_level("INFO"):
        model = build_model(cfg, 5, checkpoint=str(path), fine_tune=True)
    assert "classifier 'head' not loaded (another class count: head.weight (7, 16), head.bias (7,))" in caplog.text
    torch.testing.assert_close(model.blocks[0].attn.qkv.weight, source.blocks[0].attn.qkv.weight)
    assert model.head.weight.shape == (5, 16)
    with pytest.raises(CheckpointMismatchError, match="head.weight: model"):
        build_model(cfg, 5, checkpoint=str(path))
    deeper = compose_config("cls", *TINY_CLS, "model.kwargs.depth=2")
    with pytest.raises(CheckpointMismatchError, match=r"missing in checkpoint \(15\): blocks.1"):
        build_model(deeper, 5, checkpoint=str(path), fine_tune=True)
    from cat.models.loading import load_for_fine_tuning

    fresh = build_model(deeper, 5)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointMismatchError):
        load_for_fine_tuning(fresh, source.state_dict())
    assert all(torch.equal(before[k], v) for k, v in fresh.state_dict().items())  # a refusal loads nothing


def test_checkpoint_ema_starts_from_the_weight_ema(tmp_path):
    """checkpoint_ema=true loads the file's model_ema, not its model weights; a file without one is refused,
    naming it."""
    from cat.errors import CheckpointError

    cfg = compose_config("cls", *TINY_CLS)
    weights, ema = build_model(cfg, 4).state_dict(), build_model(cfg, 4).state_dict()
    path = tmp_path / "with_ema.pth"
    torch.save({"model": weights, "model_ema": ema}, path)
    from_ema = build_model(compose_config("cls", *TINY_CLS, "checkpoint_ema=true"), 4, checkpoint=str(path))
    from_model = build_model(cfg, 4, checkpoint=str(path))
    for key, value in from_ema.state_dict().items():
        torch.testing.assert_close(value, ema[key])
        torch.testing.assert_close(from_model.state_dict()[key], weights[key])
    assert not torch.equal(ema["head.weight"], weights["head.weight"])
    torch.save({"model": weights}, tmp_path / "without.pth")
    with pytest.raises(CheckpointError, match=r"without.pth holds no weight EMA"):
        build_model(
            compose_config("cls", *TINY_CLS, "checkpoint_ema=true"), 4, checkpoint=str(tmp_path / "without.pth")
        )
