"""A model named on a tool's command line: ``--model``, ``--model-arg KEY=VALUE``, ``--checkpoint``,
``--img-size``, ``--seed``, built the one way every tool builds it."""

from __future__ import annotations

import argparse

import torch
from torch import nn

import cat
from cat.models import parse_model_args

__all__ = [
    "add_model_arguments",
    "model_from_args",
    "model_tool_parser",
    "positive_int",
    "non_negative_int",
    "device_name",
    "check_model_size",
]


def positive_int(text: str) -> int:
    """An argparse type: a size or count, 1 or more."""
    if not text.isdigit() or int(text) <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return int(text)


def non_negative_int(text: str) -> int:
    """An argparse type: a count that may be 0 (warm-up iterations)."""
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer >= 0")
    return int(text)


def device_name(text: str) -> str:
    """An argparse type: ``cpu``, or ``cuda``/``cuda:N`` where this machine has that GPU."""
    if text == "cpu":
        return text
    kind, _, index = text.partition(":")
    if kind != "cuda" or (index and not index.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r} is not cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: CUDA is not available on this machine")
    if index and int(index) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return text


def check_model_size(name: str, img_size: int, **kwargs: object) -> None:
    """A ConfigError naming the model and the size where ``name`` does not build or run at ``img_size``
    (a forward on the meta device), before a real model is built, loaded or traced at it."""
    from cat.flops import model_cost

    model_cost(name, (img_size, img_size), **kwargs)


def add_model_arguments(parser: argparse.ArgumentParser, default: str, help: str, img_size: int = 224) -> None:
    parser.add_argument("--model", default=default, help=help)
    parser.add_argument(
        "--model-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra model argument (YAML value), e.g. --model-arg patch_size=4; repeatable",
    )
    parser.add_argument("--checkpoint", default=None, help="weights to load (release format, state dict or cat's)")
    parser.add_argument("--img-size", type=positive_int, default=img_size)
    parser.add_argument("--seed", type=int, default=0, help="seeds the weights of a model without --checkpoint")


def model_from_args(args: argparse.Namespace) -> nn.Module:
    """The model the arguments name, in eval mode (random weights seeded by ``--seed`` without a checkpoint)."""
    kwargs = parse_model_args(args.model_arg)
    check_model_size(args.model, args.img_size, **kwargs)
    torch.manual_seed(args.seed)
    return cat.create_model(args.model, checkpoint=args.checkpoint, img_size=args.img_size, **kwargs).eval()


def model_tool_parser(description: str, out_help: str, default: str, help: str) -> argparse.ArgumentParser:
    """The parser of a tool that analyses one model and writes into ``--out``."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help=out_help)
    add_model_arguments(parser, default, help)
    return parser
