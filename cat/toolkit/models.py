"""A model named on a tool's command line: ``--model``, ``--model-arg KEY=VALUE``, ``--checkpoint``,
``--img-size``, ``--seed``, built the one way every tool builds it."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from timm.models import get_pretrained_cfg_value
from torch import Tensor, nn

import cat
from cat.errors import ConfigError
from cat.models import (
    CheckpointMismatchError,
    extract_state_dict,
    load_checkpoint_file,
    load_weights,
    model_arguments,
    model_kwargs,
    parse_model_args,
)

from .cli import positive_int

__all__ = [
    "add_model_arguments",
    "model_from_args",
    "model_tool_parser",
    "check_model_size",
]


def check_model_size(name: str, img_size: int, **kwargs: object) -> None:
    """A ConfigError naming the model and the size where ``name`` does not build or run at ``img_size``
    (a forward on the meta device), before a real model is built, loaded or traced at it."""
    from cat.flops import model_cost

    model_cost(name, (img_size, img_size), **kwargs)


def add_model_arguments(parser: argparse.ArgumentParser, default: str, help: str, img_size: int = 224) -> None:
    parser.add_argument(
        "--model",
        default=None,
        help=f"{help} (default: {default}, or the model a run of train_cls.py trained when --checkpoint is its file)",
    )
    parser.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra model argument (YAML value), e.g. --model-arg patch_size=4; repeatable",
    )
    parser.add_argument("--checkpoint", default=None, help="weights to load (release format, state dict or cat's)")
    parser.add_argument(
        "--ema",
        action="store_true",
        help="load the checkpoint's weight EMA (a run's ema.enabled=true; timm's state_dict_ema) instead of its "
        "model weights",
    )
    parser.add_argument(
        "--img-size",
        type=positive_int,
        default=None,
        help=f"input size (default: {img_size}, or the size a run of train_cls.py trained at)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights of a model without --checkpoint")
    parser.set_defaults(default_model=default, default_img_size=img_size)


def model_from_args(args: argparse.Namespace) -> nn.Module:
    """The model the arguments name, in eval mode, and ``args.model`` and ``args.img_size`` set to what it is.

    A ``--checkpoint`` written by ``train_cls.py`` (it records its run's config) without ``--model`` gives the
    model that run trained: its name, ``model.kwargs`` (``--model-arg`` over them), ``model.convert`` and class
    count, at the run's input size unless ``--img-size``. Otherwise ``--model`` (random weights seeded by
    ``--seed`` without a checkpoint). ``--ema`` loads the checkpoint's weight EMA instead of its model weights."""
    from cat.classification.checkpoints import recorded_config

    overrides = parse_model_args(args.model_arg)
    if args.ema and args.checkpoint is None:
        raise ConfigError("--ema loads a checkpoint's weight EMA: give the file with --checkpoint")
    entries = None if args.checkpoint is None else load_checkpoint_file(args.checkpoint)
    state_dict = None if entries is None else extract_state_dict(entries, args.checkpoint, use_ema=args.ema)
    trained = recorded_config(entries)
    if trained is not None and state_dict is not None and args.model is None:
        return _model_of_run(args, trained, state_dict, overrides).eval()
    args.model = args.model or args.default_model
    args.img_size = args.img_size or args.default_img_size
    check_model_size(args.model, args.img_size, **overrides)
    torch.manual_seed(args.seed)
    accepted = model_arguments(args.model)
    sized = {"img_size": args.img_size} if accepted is None or "img_size" in accepted else {}  # a convnet: any size
    model = cat.create_model(args.model, **sized, **overrides)
    if state_dict is not None:
        try:
            load_weights(model, state_dict, source=args.checkpoint)
        except CheckpointMismatchError as error:
            if trained is None:
                raise
            raise CheckpointMismatchError(
                error.report,
                args.checkpoint,
                f"a run of train_cls.py trained it as {trained['model']['name']}: leave out --model to build that "
                "model as the run did",
            ) from None
    return model.eval()


def _model_of_run(
    args: argparse.Namespace, trained: dict[str, Any], state_dict: dict[str, Tensor], overrides: dict[str, Any]
) -> nn.Module:
    """The model a classification run trained, built by its trainer's builder from the config its checkpoint
    records, with ``state_dict`` loaded."""
    from cat.classification.checks import recorded_model_config
    from cat.classification.model_building import build_model

    run = recorded_model_config(trained, args.checkpoint, args.img_size)
    run.model.kwargs = {**run.model.kwargs, **overrides}
    args.model, args.img_size = run.model.name, run.img_size
    check_model_size(args.model, args.img_size, **model_kwargs(run.model.drop_path_rate, run.model.kwargs))
    # A folder dataset's run records no class count: its classifier has it.
    head = state_dict.get(f"{get_pretrained_cfg_value(args.model, 'classifier') or 'head'}.weight")
    num_classes = run.num_classes or (len(head) if head is not None else 1000)
    return build_model(
        run.model, num_classes, args.img_size, args.checkpoint, state_dict=state_dict, trained_config=trained
    )


def model_tool_parser(description: str, out_help: str, default: str, help: str) -> argparse.ArgumentParser:
    """The parser of a tool that analyses one model and writes into ``--out``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help=out_help)
    add_model_arguments(parser, default, help)
    return parser
