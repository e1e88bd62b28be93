"""Classify one image with a model and print its top-5 classes.

The image is preprocessed as the model's pretrained config says (timm's evaluation transform: resize, centre crop,
normalise), and a 1000-class model's classes are named by ImageNet-1K's labels (timm's ``ImageNetInfo``).

    python tools/predict.py photo.jpg --model ca_deit_small --pretrained    # the authors' released weights
    python tools/predict.py photo.jpg --checkpoint outputs/cls/ca_deit_s/best.pth     # a run of train_cls.py
    python tools/predict.py --model ca_deit_tiny --pretrained                # scikit-image's photo of a cat

``--pretrained`` downloads the release once (CA-DeiT-T/S/B: the only released weights) into timm's cache
(``~/.cache/torch/hub/checkpoints``) and reads it with cat's safe loader.
"""

from __future__ import annotations

import argparse
import sys

import torch
from PIL import Image
from timm.data import ImageNetInfo, create_transform, resolve_data_config

import cat
from cat.errors import ConfigError
from cat.runtime import report_user_errors
from cat.toolkit.cli import int_between
from cat.toolkit.images import load_images, sample_images
from cat.toolkit.models import add_model_arguments, model_from_args


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("image", nargs="?", default=None, help="an image file (default: scikit-image's cat photo)")
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
    if args.pretrained:
        model = cat.create_model(args.model or args.default_model, pretrained=True).eval()
    else:
        model = model_from_args(args)
    (image,) = load_images(args.image, 1) if args.image else sample_images(("chelsea",))
    config = resolve_data_config({}, model=model)
    batch = create_transform(**config)(Image.fromarray(image)).unsqueeze(0)
    with torch.inference_mode():
        probabilities = model(batch).softmax(-1)[0]
    names = ImageNetInfo() if probabilities.numel() == 1000 else None
    top = probabilities.topk(min(args.top, probabilities.numel()))
    for rank, (probability, index) in enumerate(zip(top.values.tolist(), top.indices.tolist(), strict=True), 1):
        label = names.index_to_description(index) if names is not None else f"class {index}"
        print(f"{rank}. {100 * probability:6.2f}%  {label}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
