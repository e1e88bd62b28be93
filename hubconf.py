"""torch.hub entry points: every model cat registers with timm, by its timm name.

    model = torch.hub.load("path/to/cat", "ca_deit_small", source="local", num_classes=100)
    model = torch.hub.load("path/to/cat", "ca_deit_small", source="local", pretrained=True)  # the release weights

Each entry is ``cat.create_model(name, pretrained=..., **kwargs)``: ``pretrained=True`` loads the authors' release as
``timm.create_model`` does (downloaded into timm's cache, read by cat's safe loader; offline, or for a model without
released weights, the same one-line error), and every other keyword goes to the model (``num_classes``,
``img_size``, ``drop_path_rate``, ``checkpoint=`` a file of cat's, timm's or the release's).
"""

from collections.abc import Callable as _Callable

import cat as _cat
from cat.models import cat_model_names as _cat_model_names

dependencies = ["torch", "timm", "yaml"]


def _entry_point(name: str) -> _Callable[..., object]:
    def entry(pretrained: bool = False, **kwargs: object) -> object:
        return _cat.create_model(name, pretrained=pretrained, **kwargs)

    entry.__name__ = entry.__qualname__ = name
    entry.__doc__ = f"cat's {name} (timm name), built by cat.create_model('{name}', pretrained=..., **kwargs)."
    return entry


for _name in _cat_model_names():
    globals()[_name] = _entry_point(_name)
