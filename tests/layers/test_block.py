"""The CA block and the attention-pattern parser."""

from __future__ import annotations

import pytest
import torch

from cat.layers import parse_attn_pattern
from cat.layers.block import CirculantBlock, CirculantBlockNHWC


def test_block_keeps_shape_prefix_tokens_and_release_names():
    block = CirculantBlock(8).eval()
    assert {"cpe.weight", "norm1.weight", "attn.proj.weight", "mlp.fc1.weight", "mlp.fc2.weight"} <= set(
        block.state_dict()
    )
    x = torch.randn(2, 12, 8)
    assert block(x, (3, 4)).shape == (2, 12, 8)
    block.num_prefix_tokens = 1
    with_cls = torch.cat([torch.randn(2, 1, 8), x], dim=1)
    out = block(with_cls, (3, 4))
    assert torch.equal(out[:, :1], with_cls[:, :1])  # the class token passes by
    torch.testing.assert_close(out[:, 1:], block.forward_tokens(x, (3, 4)))


def test_nhwc_block_is_the_token_block():
    tokens = CirculantBlock(8).eval()
    nhwc = CirculantBlockNHWC(8).eval()
    nhwc.load_state_dict(tokens.state_dict())
    x = torch.randn(2, 3, 4, 8)
    torch.testing.assert_close(nhwc(x), tokens(x.reshape(2, 12, 8), (3, 4)).reshape(2, 3, 4, 8))


@pytest.mark.parametrize(("pattern", "counts"), [("CCSS", [2, 2, 0, 0]), ("CM1SM2", [2, 1, 0, 2])])
def test_attn_pattern(pattern, counts):
    assert parse_attn_pattern(pattern, (2, 2, 6, 2)) == counts


REPARAMETERIZED = {  # (kwargs, input side): small grids and few channels (the kernels run in Triton's interpreter)
    "ca_deit_tiny": ({"img_size": 16, "depth": 2, "embed_dim": 8, "patch_size": 4}, 16),
    "ca_pvt_tiny": ({"depths": (1, 1, 1, 1), "embed_dims": (8, 16, 40, 64)}, 64),
}


@pytest.mark.parametrize(
    ("name", "kernel"), [("ca_deit_tiny", "aten"), ("ca_deit_tiny", "triton"), ("ca_pvt_tiny", "aten")]
)
def test_a_reparameterized_model_gives_the_same_outputs_with_two_operators_fewer_a_block(name, kernel):
    """timm.utils.reparameterize_model (timm's --reparam): each circulant block adds its convolution's centre tap
    and joins its projections' weights once; the logits and the gradients are the same on the ATen path and
    through the kernels, whose inference then issues two operators fewer a block, and the renamed state dict keeps
    a checkpoint of one form from loading into the other."""
    import timm
    from timm.utils.model import reparameterize_model

    import cat  # noqa: F401  (registers cat's models with timm)
    from cat.ops import set_attention_kernel
    from cat.toolkit.dispatch import count_kernels

    torch.manual_seed(0)
    kwargs, side = REPARAMETERIZED[name]
    model = set_attention_kernel(timm.create_model(name, **kwargs).eval(), kernel)
    x = torch.randn(1, 3, side, side)
    fused = reparameterize_model(model)
    torch.testing.assert_close(fused(x), model(x), rtol=1e-6, atol=1e-6)
    model(x).square().sum().backward()
    fused(x).square().sum().backward()
    pairs = zip(
        (m for m in model.modules() if isinstance(m, CirculantBlock)),
        (m for m in fused.modules() if isinstance(m, CirculantBlock)),
        strict=True,
    )
    for block, fused_block in pairs:
        joined = torch.cat([block.attn.qkv.weight.grad, block.attn.gate[0].weight.grad])
        torch.testing.assert_close(fused_block.attn.qkv_gate.weight.grad, joined, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(fused_block.cpe_with_identity.weight.grad, block.cpe.weight.grad)
    if kernel == "triton":
        with torch.no_grad():
            counts = [sum(count_kernels(lambda m=m: m(x)).values()) for m in (model, fused)]
        assert counts[0] - counts[1] == 2 * kwargs["depth"], counts
    names = {key.split(".")[-2] for key in fused.state_dict() if "." in key}
    assert {"cpe_with_identity", "qkv_gate", "attn"} <= names and not {"cpe", "qkv"} & names, names
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*cpe_with_identity\.weight"):
        fused.load_state_dict(model.state_dict())
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*cpe\.weight"):
        model.load_state_dict(fused.state_dict())
