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
