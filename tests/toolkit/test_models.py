"""A model named on a tool's command line: ``--model``, or the model a training run's checkpoint records."""

from __future__ import annotations

import os

import pytest
import torch

from cat.classification.checkpoints import recorded_config
from cat.classification.job import run
from cat.classification.model_building import build_model
from cat.errors import CheckpointError, ConfigError
from cat.models import CheckpointMismatchError, load_checkpoint_file
from cat.toolkit import model_from_args, model_tool_parser
from tests.conftest import TINY_CLS, TINY_CONVERTED, compose_config, typed_config


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The checkpoints of two real training runs: TINY_CLS's CA-DeiT with a weight EMA, and a converted DeiT."""
    root = tmp_path_factory.mktemp("runs")
    run(compose_config("cls", *TINY_CLS, "epochs=3", "ema.enabled=true", f"output_dir={root / 'ca'}"))
    run(compose_config("cls", *TINY_CLS, *TINY_CONVERTED, "epochs=1", f"output_dir={root / 'converted'}"))
    return root


def tool_args(*args: str):
    return model_tool_parser("", "output folder", "ca_deit_tiny", "a model").parse_args(["--out", "unused", *args])


@pytest.mark.parametrize("name, overrides", [("ca", []), ("converted", TINY_CONVERTED)])
def test_a_runs_checkpoint_gives_the_model_it_trained(runs, name, overrides):
    checkpoint = str(runs / name / "best.pth")
    cfg = typed_config("cls", *TINY_CLS, *overrides)
    trained = build_model(cfg.model, 4, cfg.data.img_size, checkpoint).eval()
    x = torch.randn(2, 3, 32, 32)

    args = tool_args("--checkpoint", checkpoint)
    model = model_from_args(args)
    assert (args.model, args.img_size) == (cfg.model.name, 32) and not model.training
    torch.testing.assert_close(model(x), trained(x), rtol=0, atol=0)

    # Another size: the run's weights at it (a fixed-size ViT's position embeddings resampled).
    args = tool_args("--checkpoint", checkpoint, "--img-size", "64")
    assert model_from_args(args)(torch.randn(1, 3, 64, 64)).shape == (1, 4) and args.img_size == 64


def test_ema_loads_the_runs_weight_ema(runs):
    checkpoint = str(runs / "ca" / "best.pth")
    saved = load_checkpoint_file(checkpoint)
    for args in (("--checkpoint", checkpoint), ("--model", "ca_deit_tiny", "--checkpoint", checkpoint)):
        if "--model" in args:  # the model named, as for a release file: the run's kwargs by hand
            kwargs = saved["config"]["model"]["kwargs"]
            args = (*args, "--img-size", "32", *(a for k, v in kwargs.items() for a in ("--model-arg", f"{k}={v}")))
            args = (*args, "--model-arg", "num_classes=4")
        own, ema = (
            model_from_args(tool_args(*args)).state_dict(),
            model_from_args(tool_args(*args, "--ema")).state_dict(),
        )
        for name, value in saved["model_ema"].items():
            assert torch.equal(ema[name], value), name
        assert any(not torch.equal(own[name], ema[name]) for name in own)  # one epoch moved the model from its EMA
    with pytest.raises(CheckpointError, match="holds no weight EMA"):
        model_from_args(tool_args("--checkpoint", str(runs / "converted" / "best.pth"), "--ema"))
    with pytest.raises(ConfigError, match="--ema loads a checkpoint's weight EMA: give the file with --checkpoint"):
        model_from_args(tool_args("--ema"))


def test_a_named_model_that_is_not_the_runs_says_which_the_run_trained(runs):
    args = tool_args("--model", "ca_deit_tiny", "--checkpoint", str(runs / "converted" / "best.pth"))
    with pytest.raises(CheckpointMismatchError) as error:
        model_from_args(args)
    assert "a run of train_cls.py trained it as deit_tiny_patch16_224: leave out --model" in str(error.value)


@pytest.mark.parametrize(
    "change, problem",
    [
        ({"model": {"kwargs": {"embed_dim": "${oc.env:CAT_TEST_SECRET}"}}}, "model: holds an interpolation (${...})"),
        ({"model": {"kwargs": [16, 1]}}, "model.kwargs=[16, 1]: expected"),
        ({"model": {"convert": "yes"}}, "model.convert='yes': expected"),
        ({"model": {"lean_attention": "sometimes"}}, "model.lean_attention='sometimes': expected one of auto"),
        ({"model": {"name": "no_such_model"}}, "model.name: unknown model 'no_such_model'"),
        ({"model": {"kwargs": {"embed_dims": 16}}}, "model.kwargs.embed_dims: not an argument of ca_deit_tiny"),
        ({"model": {"kwargs": {"depth": -1}}}, "model.kwargs.depth=-1: sizes the network, must be positive"),
        ({"data": {"img_size": "32"}}, "data.img_size='32': expected an integer >= 1"),
        ({"data": {"num_classes": 0}}, "data.num_classes=0: expected an integer >= 1"),
    ],
)
def test_a_recorded_config_that_builds_no_model_is_named(runs, change, problem, tmp_path, monkeypatch):
    """The file is the user's: what its config says is checked as a config is, nothing in it is resolved."""
    monkeypatch.setenv("CAT_TEST_SECRET", "hunter2")
    saved = load_checkpoint_file(runs / "ca" / "best.pth")
    for section, values in change.items():
        saved["config"][section] = {**saved["config"][section], **values}
    path = tmp_path / "best.pth"
    torch.save(saved, path)
    with pytest.raises(CheckpointError) as error:
        model_from_args(tool_args("--checkpoint", str(path)))
    message = str(error.value)
    assert message.startswith(f"{path}: its recorded run config builds no model: ") and problem in message, message
    assert "hunter2" not in message and os.environ["CAT_TEST_SECRET"] == "hunter2"


def test_only_a_run_config_of_cats_is_a_recorded_one(runs):
    saved = load_checkpoint_file(runs / "ca" / "best.pth")
    assert recorded_config(saved)["model"]["name"] == "ca_deit_tiny"
    deep: dict = {}
    for _ in range(40):
        deep = {"a": deep}
    for config in (None, [1], {"model": "ca_deit_tiny"}, {"model": {"name": 3}}, {"model": {"name": "x"}, "d": deep}):
        assert recorded_config({**saved, "config": config}) is None
    assert recorded_config(saved["model"]) is None  # a bare state dict
