"""The command-line pieces the tools share: argparse types for sizes, counts and devices, and the toy
datasets' parser."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from pathlib import Path

import torch

from cat.errors import OutputError

__all__ = [
    "positive_int",
    "non_negative_int",
    "int_between",
    "float_between",
    "output_folder",
    "device_name",
    "toy_dataset_parser",
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


def int_between(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer from ``low`` to ``high`` (a resolution, a number of rounds): what is past it
    would run out of memory or time rather than measure anything."""

    def parse(text: str) -> int:
        if not text.lstrip("-").isdigit() or len(text) > 12 or not low <= int(text) <= high:
            raise argparse.ArgumentTypeError(f"{text!r:.40} is not an integer from {low} to {high}")
        return int(text)

    return parse


def float_between(low: float, high: float) -> Callable[[str], float]:
    """An argparse type: a finite number above ``low`` and at most ``high`` (a duration in seconds)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and low < value <= high):
            raise argparse.ArgumentTypeError(f"{text!r:.40} is not a number above {low:g} and at most {high:g}")
        return value

    return parse


def output_folder(path: str | os.PathLike) -> Path:
    """``path``, a folder a tool writes its results in: made (with its parents) if absent; an OutputError naming it
    where it cannot be (a file stands there or on its way, the place is not writable)."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise OutputError(f"--out {folder}: a file stands at it or on the way to it, not a folder") from None
    except OSError as error:
        raise OutputError(f"--out {folder}: cannot make the folder ({error.strerror or error})") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise OutputError(f"--out {folder}: the folder cannot be written")
    return folder


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
