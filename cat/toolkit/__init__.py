"""What the tools (and the trainers' throughput mode) share: timing, models named on a command
line, sample images and figure saving. Nothing here is a tool itself; ``tools/`` holds those."""

from .cli import device_name, non_negative_int, positive_int, toy_dataset_parser
from .figures import save_figure
from .images import IMAGE_SUFFIXES, load_images, sample_images, to_model_input
from .models import (
    add_model_arguments,
    check_model_size,
    model_from_args,
    model_tool_parser,
)
from .timing import (
    interleaved_medians,
    median_quartiles,
    op_differences,
    op_self_ms,
    paired_ratios,
    paired_speedups,
    peak_growth_mib,
    peak_memory_mib,
    reset_peak_memory,
    rotated,
    synchronize,
    time_calls,
)

__all__ = [
    "save_figure",
    "IMAGE_SUFFIXES",
    "load_images",
    "sample_images",
    "to_model_input",
    "add_model_arguments",
    "model_from_args",
    "positive_int",
    "non_negative_int",
    "device_name",
    "check_model_size",
    "toy_dataset_parser",
    "model_tool_parser",
    "interleaved_medians",
    "median_quartiles",
    "op_differences",
    "op_self_ms",
    "paired_ratios",
    "paired_speedups",
    "peak_growth_mib",
    "peak_memory_mib",
    "reset_peak_memory",
    "rotated",
    "synchronize",
    "time_calls",
]
