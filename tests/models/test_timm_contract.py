"""timm's model contract, for every registered model: the pretrained config, the head API, the
feature API, FX tracing, TorchScript and torch.export at dynamic batch and resolution."""

from __future__ import annotations

import warnings

import onnxruntime as ort
import pytest
import timm
import torch
from timm.layers import get_notrace_functions, get_notrace_modules
from timm.models import model_entrypoint
from timm.models._features_fx import create_feature_extractor as timm_fx_extractor
from torchvision.models.feature_extraction import create_feature_extractor as tv_fx_extractor

import cat
import cat.export
from tests.conftest import QUICK_MODELS, quick_few

OURS = sorted(n for n in timm.list_models() if model_entrypoint(n).__module__.startswith("cat."))
# The analogous timm family's forward_features layout.
VIT_TOKENS = ("ca_deit", "deit_small_reweight")  # (B, [prefix +] N, C), like VisionTransformer
CLASS_TOKEN = ("pvt_", "ca_pvt_")  # PVT v1 classifies through a class token: ViT's layout, prefix first
NHWC = ("ca_swin",)  # like timm's SwinTransformer


def layout(name: str) -> str:
    if name.startswith(VIT_TOKENS) or name.startswith(CLASS_TOKEN):
        return "tokens"
    return "NHWC" if name.startswith(NHWC) else "NCHW"


def shallow(name: str) -> dict:
    return {"depth": 1} if name.startswith(VIT_TOKENS) else {"depths": (1, 1, 1, 1)}


def create(name: str, **kwargs) -> torch.nn.Module:
    """The model for a contract check: the tiny variants as registered, the wider ones at one block
    per stage (the contract is the family's code; depth only repeats its blocks)."""
    if name.startswith("deit_"):  # timm's ViT fixes its input size unless asked not to
        kwargs.setdefault("dynamic_img_size", True)
    if not name.endswith("tiny"):  # ViTs keep 3 blocks: features_only takes the last three
        kwargs = {**({"depth": 3} if name.startswith(VIT_TOKENS) else shallow(name)), **kwargs}
    return timm.create_model(name, **kwargs)


def small_input(model: torch.nn.Module, batch: int = 2, size: tuple[int, int] = (64, 96)) -> torch.Tensor:
    return torch.randn(batch, model.pretrained_cfg["input_size"][0], *size)


@pytest.mark.parametrize("name", quick_few(OURS, QUICK_MODELS))
def test_pretrained_config_and_head_api(name):
    model = create(name).eval()
    cfg = model.pretrained_cfg
    params = model.state_dict()
    assert f"{cfg['first_conv']}.weight" in params and f"{cfg['classifier']}.weight" in params
    assert cfg["mean"] and cfg["std"] and cfg["crop_pct"] and cfg["input_size"][0] == 3
    assert model.num_features and model.head_hidden_size == model.num_features
    x = torch.randn(1, *cfg["input_size"])
    with torch.no_grad():
        features = model.forward_features(x)
        kind = layout(name)
        if kind == "tokens":
            assert features.dim() == 3 and features.shape[-1] == model.num_features
        else:
            spatial = features.shape[-2:] if kind == "NCHW" else features.shape[1:3]
            channels = features.shape[1] if kind == "NCHW" else features.shape[-1]
            assert tuple(spatial) == tuple(cfg["pool_size"]) and channels == model.num_features
        if cfg["pool_size"] is not None and kind == "tokens":  # PVT: the pool size is its last grid
            assert features.shape[1] == 1 + cfg["pool_size"][0] * cfg["pool_size"][1]
        assert model.forward_head(features, pre_logits=True).shape == (1, model.head_hidden_size)
        assert model.forward_head(features).shape == (1, cfg["num_classes"])
        model.reset_classifier(0)
        assert model(x).shape == (1, model.num_features)
        model.reset_classifier(7)
        assert model(x).shape == (1, 7) and model.get_classifier().out_features == 7


@pytest.mark.parametrize("name", quick_few(OURS, QUICK_MODELS))
def test_features_only_and_intermediates(name):
    model = create(name, features_only=True).eval()
    x = small_input(model, batch=1)
    with torch.no_grad():
        maps = model(x)
    assert [m.shape[1] for m in maps] == model.feature_info.channels()
    for m, stride in zip(maps, model.feature_info.reduction(), strict=True):
        assert m.dim() == 4 and tuple(m.shape[-2:]) == (-(-64 // stride), -(-96 // stride))

    full = create(name).eval()
    last = len(full.feature_info) - 1
    with torch.no_grad():
        final, inter = full.forward_intermediates(x, indices=[0, last])
        assert [i.shape[1] for i in inter] == [full.feature_info[0]["num_chs"], full.feature_info[last]["num_chs"]]
        torch.testing.assert_close(final, full.forward_features(x))
        kept = full.prune_intermediate_layers([0], prune_norm=True)
        assert kept == [0]
        torch.testing.assert_close(full.forward_intermediates(x, indices=[0], intermediates_only=True)[0], inter[0])
    # What is left is what index 0 needs (DDP refuses parameters without gradients); CA-PVT and CAT kept later stages.
    full.forward_intermediates(x, indices=[0], intermediates_only=True)[0].sum().backward()
    assert [name for name, p in full.named_parameters() if p.grad is None] == []


def leaf_kwargs() -> dict:
    return {"leaf_modules": get_notrace_modules(), "autowrap_functions": get_notrace_functions()}


@pytest.mark.parametrize("name", quick_few(OURS, QUICK_MODELS))
def test_fx_feature_extraction(name):
    """torchvision's create_feature_extractor (given timm's leaf registry) and timm's own, then
    TorchScript over timm's graph; circulant attention stays one leaf call, and gradients flow
    through it."""
    model = create(name, num_classes=5).eval()
    x = small_input(model, batch=2, size=(64, 64))
    timm_graph = timm_fx_extractor(model, {"head": "logits"})
    torchvision_graph = tv_fx_extractor(model, {"head": "logits"}, tracer_kwargs=leaf_kwargs())
    with torch.no_grad():
        expected = model(x)
        torch.testing.assert_close(timm_graph(x)["logits"], expected)
    logits = torchvision_graph(x)["logits"]
    torch.testing.assert_close(logits, expected)
    with warnings.catch_warnings():  # timm's --torchscript on a feature extractor: FX, then script
        warnings.simplefilter("ignore", DeprecationWarning)
        scripted = torch.jit.script(timm_graph)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x)["logits"], expected)
    logits.square().sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("name", quick_few(OURS, QUICK_MODELS))
def test_torchscript(name):
    """timm's --torchscript. The FFT attention runs as a Python call inside the scripted module
    (``torch.jit.ignore``), so scripted CA models run but cannot be saved: torch.export serialises."""
    model = create(name, num_classes=5).eval()
    x = small_input(model, batch=1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch 2.14 deprecates TorchScript
        scripted = torch.jit.script(model)
    with torch.no_grad():
        torch.testing.assert_close(scripted(x), model(x))


# One model per family: at one block per stage the wider variants run the same graph at other widths,
# and export is the slowest check here (tens of seconds a model on 2 cores): CA-DeiT-T in the quick
# tier, the other families in the full suite.
EXPORTED = [
    pytest.param(n, marks=() if n == "ca_deit_tiny" else pytest.mark.slow)
    for n in OURS
    if n.endswith("tiny") or n.startswith("deit_")
]


def test_export_puts_every_module_back_in_its_mode():
    """A model exported mid-training trains on as before: the export runs in eval mode, then every module is back
    in its own mode (here the model training, with its final norm kept in eval mode)."""
    model = create("ca_deit_tiny", num_classes=5, **shallow("ca_deit_tiny")).train()
    model.norm.eval()
    cat.export.export_program(model, small_input(model))
    assert not model.norm.training and all(m.training for m in model.modules() if m is not model.norm)


@pytest.mark.slow  # torch.export and ONNX: seconds per model
@pytest.mark.parametrize("name", EXPORTED)
def test_export_and_onnx_at_any_batch_and_resolution(name):
    """One torch.export program and one ONNX model (FFTs as DFT) for every batch and resolution,
    checked against eager torch at two. Each model's configuration at one block per stage: export
    time grows with depth, and every block type of the model is there at depth 1."""
    model = create(name, num_classes=5, **shallow(name)).eval()  # tiny ones too: export time grows with depth
    # timm's Swin window stages make torch.export's symbolic shape solver run for minutes per block
    # at a dynamic resolution (padding to windows); CA-Swin is exported at a fixed one, any batch.
    dynamic_size = not name.startswith("ca_swin")
    exported = cat.export.export_program(model, small_input(model), dynamic_size=dynamic_size)
    onnx_model = ort.InferenceSession(cat.export.program_to_onnx(exported).SerializeToString())
    program = exported.module()
    for batch, *size in ((3, 64, 128), (1, 128, 64)) if dynamic_size else ((3, 64, 96), (1, 64, 96)):
        x = small_input(model, batch=batch, size=size)
        with torch.no_grad():
            expected = model(x)
            torch.testing.assert_close(program(x), expected, rtol=1e-4, atol=1e-5)
        got = onnx_model.run(None, {onnx_model.get_inputs()[0].name: x.numpy()})[0]
        torch.testing.assert_close(torch.from_numpy(got), expected, rtol=1e-4, atol=1e-4)
