"""Classify an image, or each image of a folder, with a model and print its top-5 classes.

Each image is read as its camera meant it (EXIF orientation applied, 16-bit greyscale scaled to 8 bits) and
preprocessed as the model's pretrained config says (timm's evaluation transform: resize, centre crop, normalise);
a 1000-class model's classes are named by ImageNet-1K's labels (timm's ``ImageNetInfo``).

    python tools/predict.py photo.jpg --model ca_deit_small --pretrained    # the authors' released weights
    python tools/predict.py photos/ --checkpoint outputs/cls/ca_deit_s/best.pth      # each image, by its name
    python tools/predict.py --model ca_deit_tiny --pretrained                # scikit-image's photo of a cat

``--pretrained`` downloads the release once (CA-DeiT-T/S/B: the only released weights) into timm's cache
(``~/.cache/torch/hub/checkpoints``) and reads it with cat's safe loader.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from PIL import Image
from timm.data import ImageNetInfo, create_transform, resolve_data_config
from timm.utils.model import reparameterize_model

import cat
from cat.errors import ConfigError
from cat.models.deit import RELEASE_URLS
from cat.runtime import report_user_errors
from cat.toolkit.cli import int_between
from cat.toolkit.images import image_paths, read_image, sample_images
from cat.toolkit.models import add_model_arguments, model_from_args

MOST_IMAGES = 1000  # of a folder, in name order


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "image",
        nargs="?",
        default=None,
        help=f"an image file, or a folder: each image in it, named (the first {MOST_IMAGES}; default: "
        "scikit-image's cat photo)",
    )
    add_model_arguments(parser, "ca_deit_small", "the model")
    parser.add_argument(
        "--pretrained", action="store_true", help="the authors' released weights (downloaded once; CA-DeiT only)"
    )
    parser.add_argument("--top", type=int_between(1, 20), default=5, metavar="K", help="classes to print (1-20)")
    return parser


@report_user_errors
def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.pretrained and args.checkpoint:
        raise ConfigError("--pretrained and --checkpoint both give weights: give one")
    paths = image_paths(args.image, MOST_IMAGES) if args.image is not None else None  # before any model is built
    if args.pretrained:
        name = args.model or args.default_model
        if name not in RELEASE_URLS:
            raise ConfigError(
                f"--pretrained: the authors released weights for {', '.join(RELEASE_URLS)} only, not {name}; give "
                "weights with --checkpoint FILE"
            )
        model = cat.create_model(name, pretrained=True).eval()
    else:
        model = model_from_args(args)
    reparameterize_model(model, inplace=True)  # inference only: weight-only work done once (CirculantBlock)
    transform = create_transform(**resolve_data_config({}, model=model))
    named = [(None, sample_images(("chelsea",))[0])] if paths is None else [(p, read_image(p)) for p in paths]
    folder = args.image is not None and os.path.isdir(args.image)
    for path, image in named:
        if folder:  # each image under its name
            print(f"{path}:")
        with torch.inference_mode():
            probabilities = model(transform(Image.fromarray(image)).unsqueeze(0)).softmax(-1)[0]
        _print_top(probabilities, args.top)
    return 0


def _print_top(probabilities: torch.Tensor, k: int) -> None:
    names = ImageNetInfo() if probabilities.numel() == 1000 else None
    top = probabilities.topk(min(k, probabilities.numel()))
    for rank, (probability, index) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
        label = names.index_to_description(index) if names is not None else f"class {index}"
        print(f"{rank}. {100 * probability:6.2f}%  {label}")


if __name__ == "__main__":
    sys.exit(main())
