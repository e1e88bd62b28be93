"""The command-line pieces the tools share: argparse types for sizes, counts and devices, and the toy
datasets' parser."""

from __future__ import annotations

import argparse

import torch

__all__ = ["positive_int", "non_negative_int", "device_name", "toy_dataset_parser"]


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


def toy_dataset_parser(description: str) -> argparse.ArgumentParser:
    """The command line both toy-dataset tools share."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=positive_int, default=64, help="training images")
    parser.add_argument("--val", type=positive_int, default=16, help="validation images")
    parser.add_argument("--size", type=positive_int, default=128, help="image side in pixels")
    parser.add_argument("--seed", type=int, default=0)
    return parser
