"""Random non-overlapping coloured shapes, for the toy COCO and ADE20K datasets of the tools."""

from __future__ import annotations

import math

import numpy as np
from PIL import Image, ImageDraw

__all__ = ["SHAPES", "place_shapes", "polygon_area", "draw_scene"]

SHAPES = ("circle", "square", "triangle")  # shape class k + 1 is SHAPES[k]


def shape_polygon(shape: int, cx: float, cy: float, r: float, angle: float) -> list[tuple[float, float]]:
    """Vertices of a circle (as a 32-gon), a square or a triangle (shape 1, 2, 3) of circumradius ``r``."""
    sides = {1: 32, 2: 4, 3: 3}[shape]
    return [
        (cx + r * math.cos(angle + 2 * math.pi * i / sides), cy + r * math.sin(angle + 2 * math.pi * i / sides))
        for i in range(sides)
    ]


def place_shapes(
    rng: np.random.Generator, size: int, max_shapes: int = 3
) -> list[tuple[int, list[tuple[float, float]]]]:
    """1 to ``max_shapes`` non-overlapping shapes on a ``size`` x ``size`` canvas: (shape class, polygon)."""
    placed: list[tuple[float, float, float]] = []
    shapes = []
    for _ in range(int(rng.integers(1, max_shapes + 1))):
        for _attempt in range(20):  # no overlaps, so every polygon is a whole instance
            r = float(rng.uniform(0.1, 0.22) * size)
            cx, cy = (float(v) for v in rng.uniform(r, size - r, 2))
            if all(math.hypot(cx - px, cy - py) > r + pr + 2 for px, py, pr in placed):
                break
        else:
            continue
        placed.append((cx, cy, r))
        shape = int(rng.integers(1, len(SHAPES) + 1))
        shapes.append((shape, shape_polygon(shape, cx, cy, r, float(rng.uniform(0, 2 * math.pi)))))
    return shapes


def polygon_area(points: list[tuple[float, float]]) -> float:
    x, y = np.array(points).T
    return float(0.5 * abs(np.dot(x, np.roll(y, 1)) - np.dot(y, np.roll(x, 1))))


def draw_scene(rng: np.random.Generator, size: int) -> tuple[Image.Image, list[tuple[int, list[tuple[float, float]]]]]:
    """A noisy dark background with bright random shapes drawn on it; returns the image and its shapes."""
    pixels = np.clip(rng.integers(0, 80, 3) + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)
    image = Image.fromarray(pixels)
    draw = ImageDraw.Draw(image)
    shapes = place_shapes(rng, size)
    for _, points in shapes:
        draw.polygon(points, fill=tuple(int(c) for c in rng.integers(120, 256, 3)))
    return image, shapes
