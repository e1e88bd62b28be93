"""Circulant attention: self-attention whose attention map is exactly BCCB.

For an H x W token grid with N = H*W tokens, a BCCB (block-circulant with circulant blocks)
attention matrix has entries that depend only on the 2-D offset between query and key on the
torus. Such a matrix is a circular convolution, so attention reduces to 2-D DFTs and costs
O(N log N) instead of O(N^2).

Conventions: the public function takes (B, H, W, C) tokens; inside, maps are channels outermost,
(C, B, H, W), so that a projection of all channels is one GEMM over the whole batch, and spectra are
the unnormalised half spectra of the maps as real (re, im) pairs, (C, B, H, W//2+1, 2)
(:mod:`cat.ops.dft`, which also sets the dtypes the transforms run in).
Training goes through one autograd function with a backward in the frequency domain
(:mod:`cat.ops.fused`); what it keeps for the backward and which DFT runs are chosen per device
(:mod:`cat.ops.policy`).
"""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .dft import DFTBackend, rfft2
from .fused import (
    circulant_attention_function,
    grid_rows,
    map_tokens,
    projected_spectra,
    stored_floats,
    token_maps,
    value_bias,
)
from .kernels.check import use_kernels
from .policy import (
    BackendPolicy,
    KernelPolicy,
    LeanPolicy,
    backend_for,
    budget_bytes,
    check_backend,
    check_kernel,
    check_lean,
    compute_dtype,
    lean_for,
)
from .precision import fft_dtype, fft_itemsize
from .spectral import attend_spectra, weights_by_offset

Reweight = Literal["post", "pre", "none"]
FFTBackend = BackendPolicy  # the name the module's argument has had


def _evaluated_annotations(fn: Callable) -> Callable:
    """``fn`` with its annotations evaluated: TorchScript reads those of an ignored function as they
    are, and this module's are strings (``from __future__ import annotations``)."""
    fn.__annotations__ = typing.get_type_hints(fn)
    return fn


def _check_head_dim(channels: int, head_dim: int) -> None:
    if head_dim < 1 or channels % head_dim:
        raise ValueError(f"head_dim={head_dim} must be a positive divisor of the channel count {channels}")


def circulant_attention(
    q: Tensor, k: Tensor, v: Tensor, head_dim: int = 1, scale: float | None = None, fft_backend: FFTBackend = "auto"
) -> Tensor:
    """Circulant (BCCB) attention over a 2-D token grid, in O(N log N).

    Args:
        q: the queries, a real tensor shaped (B, H, W, C): the tokens laid out on their H x W grid.
        k: the keys, shaped as ``q``.
        v: the values, shaped as ``q``.
        head_dim: channels per head; C must be divisible by it. ``1`` (per-channel attention) is
            what the released CA-DeiT uses.
        scale: multiplies the logits. ``None`` means ``1 / sqrt(N * head_dim)`` with N = H*W, the
            scale the released CA-DeiT computes; the paper writes ``1 / (N * sqrt(d))``, which can
            be passed explicitly. Any float is accepted.
        fft_backend: how the 2-D DFTs run (:mod:`cat.ops.dft`): ``'fft'`` (torch.fft), ``'separable'``
            (two GEMMs per transform), ``'matmul'`` (one dense GEMM: ONNX-exportable), or ``'auto'``
            (:func:`cat.ops.policy.backend_for`: fft, unless ``tools/gpu_check.py`` recorded the separable DFT as
            faster on this card under half-precision autocast).

    For each batch item and head, with offsets d on the H x W torus (``+`` modulo (H, W)):
        logits[d] = scale * sum_i <q_i, k_{i+d}>      (QK^T projected onto the BCCB subspace, times N)
        w = softmax(logits) over the N offsets
        out_i = sum_d w[d] * v_{i+d}                  (per channel of the head)

    The spectra are float32 (float64 for float64 inputs) whatever autocast is active (the fft
    backend also transforms in float32; the GEMM backends in autocast's dtype); the result has the
    promoted dtype of the inputs.
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"circulant_attention expects {name} shaped (B, H, W, C); got shape {tuple(t.shape)}")
        if t.is_complex():
            raise ValueError(f"circulant_attention expects real tensors; {name} is {t.dtype}")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have the same shape; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    B, H, W, C = q.shape
    _check_head_dim(C, head_dim)
    out_dtype = torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype)
    work = fft_dtype(out_dtype)
    backend = backend_for(check_backend(fft_backend), q.device, compute_dtype(q))
    q_f, k_f, v_f = (rfft2(t.to(work).permute(3, 0, 1, 2), backend, t is not v, norm="ortho") for t in (q, k, v))
    out = attend_spectra(q_f, k_f, v_f, (H, W), head_dim, scale, backend)[0]
    return out.permute(1, 2, 3, 0).to(out_dtype)


class CirculantAttention(nn.Module):
    """Circulant attention with the SiLU token gate, as in the released CA-DeiT.

    Called as ``attn(x, hw)`` with x (B, N, C) and hw = (H, W), H*W = N. Parameter names follow the
    released checkpoints: ``qkv.weight`` (bias-free, 3C x C), ``gate.0.{weight,bias}``,
    ``proj.{weight,bias}``.

    The qkv weight is applied to the real and imaginary parts of the spectrum of x: the DFT is
    linear, so this equals projecting before the transform while taking one transform instead of
    three (``pack_spectrum=True``: to the spectrum's N independent reals; docs/perf.md compares them).
    With post- or no reweighting, gate, attention and projection run as one autograd function
    (:mod:`cat.ops.fused`) whose backward works in the frequency domain; ``lean`` chooses what its
    forward keeps: ``False`` the spectra (the faster), ``True`` only x and the gate's pre-activation,
    recomputing the rest in the backward in channel groups sized by the memory budget (the least
    memory), ``'auto'`` (default) by device and size (:mod:`cat.ops.policy`). ``memory_mb`` is that
    budget in MiB (None: a share of the device's free memory; :func:`cat.ops.set_attention_memory`).
    ``fft_backend`` chooses the DFTs (:func:`circulant_attention`); ``attention_kernel`` whether the attention runs
    as one Triton kernel each way ('triton', :mod:`cat.ops.kernels`), the ATen path above ('aten') or, 'auto', the
    kernels on CUDA where the grid fits on chip (:func:`cat.ops.policy.kernel_for`). :func:`set_lean_attention`,
    :func:`set_fft_backend` and :func:`set_attention_kernel` set a whole model.
    With ``keep_weights = True`` each forward stores its attention weights (the equivalent global
    convolution kernel per head) in ``last_weights``, shaped (B, heads, H, W).

    ``reweight`` selects the token reweighting of the paper's Table 5: ``'post'`` (default,
    out = CirAttn(Q, K, V) * T), ``'pre'`` (out = CirAttn(Q, K, V * T)) or ``'none'``, where
    T = SiLU(Linear(x)).
    """

    def __init__(
        self,
        dim: int,
        head_dim: int = 1,
        reweight: Reweight = "post",
        proj_drop: float = 0.0,
        scale: float | None = None,
        fft_backend: FFTBackend = "auto",
        pack_spectrum: bool = False,
        lean: LeanPolicy = "auto",
        memory_mb: int | None = None,
        attention_kernel: KernelPolicy = "auto",
    ) -> None:
        super().__init__()
        _check_head_dim(dim, head_dim)
        if reweight not in ("post", "pre", "none"):
            raise ValueError(f"reweight must be 'post', 'pre' or 'none'; got {reweight!r}")
        self.dim = dim
        self.head_dim = head_dim
        self.reweight = reweight
        self.scale = scale
        self.fft_backend = check_backend(fft_backend)
        self.pack_spectrum = pack_spectrum
        self.lean = check_lean(lean)
        self.memory_mb = memory_mb
        self.attention_kernel = check_kernel(attention_kernel)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.gate = nn.Sequential(nn.Linear(dim, dim), nn.SiLU()) if reweight != "none" else None
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)
        # Set by reparameterize: q, k, v's and the gate's weights as one (4C, C) Linear, and the gate's bias.
        self.qkv_gate: nn.Linear | None = None
        self.register_parameter("gate_bias", None)
        # Analysis tools set keep_weights to read each forward's attention weights (B, heads, H, W).
        self.keep_weights = False
        self.last_weights: Tensor | None = None

    def extra_repr(self) -> str:
        return (
            f"dim={self.dim}, head_dim={self.head_dim}, reweight={self.reweight!r}, "
            f"fft_backend={self.fft_backend!r}, lean={self.lean}, attention_kernel={self.attention_kernel!r}"
        )

    def reparameterize(self) -> None:
        """For inference (``timm.utils.reparameterize_model``; timm's benchmark and validate scripts' ``--reparam``):
        q, k, v's and the gate's weights joined once into one (4C, C) Linear, ``qkv_gate``, so that the kernels' path
        joins no weights at every call (one operator a block). The outputs are the same; the state dict then names
        ``qkv_gate.weight`` and ``gate_bias`` for ``qkv.weight`` and ``gate.0``, so a checkpoint of one form does not
        load into the other (a missing or unexpected key, by name). One way, as timm's reparameterizations are."""
        if self.gate is None or self.qkv_gate is not None:
            return
        gate = cast(nn.Linear, self.gate[0])
        weight = self.qkv.weight
        self.qkv_gate = nn.Linear(self.dim, 4 * self.dim, bias=False, device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.qkv_gate.weight.copy_(torch.cat([weight, gate.weight]))
        self.gate_bias = nn.Parameter(gate.bias.detach().clone(), requires_grad=gate.bias.requires_grad)
        del self.qkv
        self.gate = None

    def forward(self, x: Tensor, hw: tuple[int, int]) -> Tensor:
        gate_weight: Tensor | None = None
        gate_bias: Tensor | None = None
        qkv_gate_weight: Tensor | None = None
        if self.qkv_gate is not None:  # reparameterized: q, k, v and the gate as views of one weight
            qkv_gate_weight = self.qkv_gate.weight
            qkv_weight = qkv_gate_weight[: 3 * self.dim]
            gate_weight, gate_bias = qkv_gate_weight[3 * self.dim :], self.gate_bias
        else:
            qkv_weight = self.qkv.weight
            if self.gate is not None:
                # A Linear (no cast: TorchScript compiles this method, and torch types a submodule's parameter loosely)
                gate_weight, gate_bias = self.gate[0].weight, self.gate[0].bias  # type: ignore[assignment]
        out, weights = circulant_attention_layer(
            x,
            hw,
            qkv_weight,
            gate_weight,
            gate_bias,
            self.proj.weight,
            self.proj.bias,
            self.head_dim,
            self.scale,
            self.reweight,
            self.fft_backend,
            self.lean,
            self.memory_mb,
            self.keep_weights,
            self.pack_spectrum,
            None,  # no qkv bias, no prefix tokens (TorchScript takes no defaults of an ignored function)
            None,
            self.attention_kernel,
            qkv_gate_weight,
        )
        if self.keep_weights and not torch.jit.is_scripting():
            self.last_weights = weights.detach()
        return self.proj_drop(out)


# TorchScript calls this as Python: the attention (an autograd.Function, autocast scopes) is not
# scriptable, so a scripted model runs but cannot be saved; torch.export gives a serialised program.
@torch.jit.ignore
@_evaluated_annotations
def circulant_attention_layer(
    x: Tensor,
    hw: tuple[int, int],
    qkv_weight: Tensor,
    gate_weight: Tensor | None,
    gate_bias: Tensor | None,
    proj_weight: Tensor,
    proj_bias: Tensor,
    head_dim: int,
    scale: float | None,
    reweight: str,
    fft_backend: str,  # BackendPolicy and LeanPolicy: TorchScript, which compiles the caller, reads no Literal
    lean: bool | str,
    memory_mb: int | None,
    keep_weights: bool,
    pack_spectrum: bool,
    qkv_bias: Tensor | None = None,
    prefix: Tensor | None = None,
    attention_kernel: str = "auto",  # KernelPolicy (TorchScript reads no Literal)
    qkv_gate_weight: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """:class:`CirculantAttention`'s computation on its weights: the output (B, N, C) before the
    dropout, and the attention weights (B, heads, H, W) (an empty tensor unless ``keep_weights``).
    For :func:`cat.convert`'s attention also: ``qkv_bias`` (3C,), and ``prefix`` (B, P, C),
    the attention outputs of P tokens before the grid (class and register tokens), which x then holds first,
    (B, P + N, C); they are gated and projected with the grid's (post- or no reweighting). ``qkv_gate_weight``: the
    (4C, C) weight ``qkv_weight`` and ``gate_weight`` are the rows of (a reparameterized module's), which the kernels'
    path then takes as it is instead of joining them.

    Of the qkv bias only v's part acts: a constant added to q or k shifts all of a head's logits alike (each
    logit sums over the whole torus), which the softmax ignores, and v's passes through weights that sum to 1
    as itself, a constant added to the output. So q's and k's get zero gradient, exactly."""
    C = qkv_weight.shape[1]
    if x.dim() != 3 or x.shape[-1] != C:
        raise ValueError(f"CirculantAttention(dim={C}) expects x shaped (B, N, {C}); got {tuple(x.shape)}")
    P = 0 if prefix is None else prefix.shape[1]
    if P and reweight == "pre":
        raise ValueError("tokens before the grid (prefix) need post- or no reweighting")
    B, T, C = x.shape
    N = T - P
    H, W = hw
    if H * W != N:
        raise ValueError(f"hw={tuple(hw)} gives {H * W} tokens but x has N={N}")
    policy = check_backend(fft_backend)
    exporting = torch.compiler.is_exporting()
    training = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (x, qkv_weight, gate_weight, proj_weight, prefix)
    )
    attend: Callable[[Tensor], Tensor] | None = None
    if policy in ("auto", "fft") and torch.jit.is_tracing() and not keep_weights:
        # From Python numbers: the tracer's sizes are tensors, whose power would round the scale to float32.
        traced_scale = (int(N) * head_dim) ** -0.5 if scale is None else float(scale)

        def attend(qkv: Tensor) -> Tensor:
            maps = (t.reshape(B, H, W, C) for t in qkv.chunk(3, dim=-1))
            return traced_circulant_attention(*maps, head_dim, traced_scale).reshape(B, N, C)

    elif (
        not keep_weights
        and not exporting
        and use_kernels(check_kernel(attention_kernel), x.device, hw, training, compute_dtype(x))
    ):
        from .kernels.launch import circulant_kernel_qkv

        if reweight == "post" and gate_weight is not None and not P:
            weight = torch.cat([qkv_weight, gate_weight]) if qkv_gate_weight is None else qkv_gate_weight
            out = _gated_kernel_layer(x, hw, weight, qkv_bias, gate_bias, head_dim, scale)
            return F.linear(out, proj_weight, proj_bias), out.narrow(0, 0, 0)

        def attend(qkv: Tensor) -> Tensor:
            return circulant_kernel_qkv(qkv, (H, W), head_dim, scale)

    if attend is not None:
        gate = F.silu(F.linear(x, gate_weight, gate_bias)) if gate_weight is not None else None
        out = _token_layer(x, qkv_weight, gate, proj_weight, proj_bias, qkv_bias, reweight, prefix, attend)
        return out, out.narrow(0, 0, 0)  # no weights: an empty view, no operator
    # None (the released scale) stays None: the orthonormal transforms apply it, with no arithmetic on N, which is
    # symbolic under torch.export (any resolution).
    backend = backend_for(policy, x.device, compute_dtype(x))
    if reweight == "pre" or exporting:
        # Through autograd: v is gated before the attention, or an exported program, which takes plain operators.
        return _autograd_layer(
            x, hw, qkv_weight, gate_weight, gate_bias, proj_weight, proj_bias, head_dim, scale, reweight, backend,
            keep_weights, qkv_bias, prefix,
        )  # fmt: skip
    budget = budget_bytes(memory_mb, x.device)
    stored = stored_floats(B * N, C, C // head_dim, hw) * fft_itemsize(x.dtype)
    return circulant_attention_function(
        x,
        qkv_weight,
        gate_weight,
        gate_bias,
        proj_weight,
        proj_bias,
        hw,
        head_dim,
        scale,
        backend,
        lean_for(check_lean(lean), stored, budget),
        budget,
        keep_weights,
        pack_spectrum,
        qkv_bias,
        prefix,
    )


def _autograd_layer(
    x: Tensor,
    hw: tuple[int, int],
    qkv_weight: Tensor,
    gate_weight: Tensor | None,
    gate_bias: Tensor | None,
    proj_weight: Tensor,
    proj_bias: Tensor,
    head_dim: int,
    scale: float | None,
    reweight: str,
    backend: DFTBackend,
    keep_weights: bool,
    qkv_bias: Tensor | None,
    prefix: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """:func:`circulant_attention_layer` through autograd's own backward: every intermediate spectrum is kept."""
    B, _, C = x.shape
    P = 0 if prefix is None else prefix.shape[1]
    gate = F.silu(F.linear(x, gate_weight, gate_bias)) if gate_weight is not None else None
    rows = grid_rows(x, P, hw, backend, packed=False)
    if reweight == "pre":  # v, not the output, is gated
        assert gate is not None  # pre-reweighting has a gate (checked by the layer)
        q_f, k_f = projected_spectra(rows, qkv_weight[: 2 * C], B, hw, packed=False).chunk(2)
        v = F.linear(x, qkv_weight[2 * C :], value_bias(qkv_bias, 0, C) if qkv_bias is not None else None) * gate
        v_f = rfft2(token_maps(v, hw), backend, norm="ortho")
    else:
        q_f, k_f, v_f = projected_spectra(rows, qkv_weight, B, hw, packed=False).chunk(3)
    y, omega, _ = attend_spectra(q_f, k_f, v_f, hw, head_dim, scale, backend)
    if qkv_bias is not None and reweight != "pre":  # v's bias, a constant through the weights ("pre": in v)
        y = y + value_bias(qkv_bias, 0, C).view(C, 1, 1, 1).to(y.dtype)
    # Token-major and contiguous before the elementwise work: on a view whose strides hold the batch, torch.export
    # orders them with guards that fail at batch 1.
    y = map_tokens(y).clone(memory_format=torch.contiguous_format)
    if prefix is not None and P:
        y = torch.cat([prefix.to(y.dtype), y], dim=1)
    if reweight == "post" and gate is not None:
        y = y * gate
    weights = weights_by_offset(omega).transpose(0, 1) if keep_weights else omega.new_empty(0)
    return F.linear(y, proj_weight, proj_bias), weights


# One operator of a torch.jit.trace graph: the trace-based FLOP counters (mmengine's get_model_complexity_info, which
# mmdet's and mmseg's get_flops.py run) see the attention whole and count it by the paper's formula (cat.mm registers
# the handle), as cat.flops does. The tracer cannot record the lean autograd.Function.
@torch.library.custom_op(
    "cat::circulant_attention",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, int head_dim, float scale) -> Tensor",
)
def traced_circulant_attention(q: Tensor, k: Tensor, v: Tensor, head_dim: int, scale: float) -> Tensor:
    """:func:`circulant_attention` (fft backend) as the operator ``cat::circulant_attention``."""
    return circulant_attention(q, k, v, head_dim, scale)


@traced_circulant_attention.register_fake
def _traced_circulant_attention_shape(q: Tensor, k: Tensor, v: Tensor, head_dim: int, scale: float) -> Tensor:
    return q.new_empty(q.shape, dtype=torch.promote_types(torch.promote_types(q.dtype, k.dtype), v.dtype))


def _token_layer(
    x: Tensor,
    qkv_weight: Tensor,
    gate: Tensor | None,
    proj_weight: Tensor,
    proj_bias: Tensor,
    qkv_bias: Tensor | None,
    reweight: str,
    prefix: Tensor | None,
    attend: Callable[[Tensor], Tensor],
) -> Tensor:
    """:func:`circulant_attention_layer`'s output with q, k and v projected in token space, as one tensor (B, N, 3C)
    (the whole qkv bias applied: q's and k's parts do not act) and attended by ``attend`` (to (B, N, C)):
    ``cat::circulant_attention`` (a trace) or the Triton kernels."""
    P = 0 if prefix is None else prefix.shape[1]
    qkv = F.linear(x[:, P:] if P else x, qkv_weight, qkv_bias)
    if reweight == "pre" and gate is not None:  # no prefix here (refused above)
        C = qkv.shape[-1] // 3
        qkv = torch.cat([qkv[..., : 2 * C], qkv[..., 2 * C :] * gate], dim=-1)
    y = attend(qkv)
    if prefix is not None and P:
        y = torch.cat([prefix.to(y.dtype), y], dim=1)
    if reweight == "post" and gate is not None:
        y = y * gate
    return F.linear(y, proj_weight, proj_bias)


def _gated_kernel_layer(
    x: Tensor,
    hw: tuple[int, int],
    weight: Tensor,
    qkv_bias: Tensor | None,
    gate_bias: Tensor | None,
    head_dim: int,
    scale: float | None,
) -> Tensor:
    """The gated attention output (B, N, C), before the output projection, through the kernels with the gate in
    them: q, k, v and the gate's pre-activation from one GEMM (B, N, 4C) with ``weight`` (4C, C), the kernels
    applying the gate's bias and SiLU and the product in the forward's epilogue, the backward making the projection
    again and recomputing (:func:`cat.ops.kernels.launch.projected_kernel`). Against projecting the gate apart and
    gating outside: one GEMM instead of two each way, and no SiLU, product or their backwards (one operator each way
    for all of it)."""
    from .kernels.launch import projected_kernel

    bias = None
    if qkv_bias is not None:  # else the gate's bias goes to the kernels (no tensor of zeros for q, k and v)
        bias = torch.cat([qkv_bias, gate_bias if gate_bias is not None else qkv_bias.new_zeros(weight.shape[1])])
        gate_bias = None
    return projected_kernel(x, weight, bias, gate_bias, hw, head_dim, scale)


def _torus_offset_index(hw: tuple[int, int], device: torch.device | None = None) -> Tensor:
    """(N, N) index of the 2-D offset (j - i) mod (H, W) between token i and token j."""
    H, W = hw
    ys, xs = torch.meshgrid(torch.arange(H, device=device), torch.arange(W, device=device), indexing="ij")
    ys, xs = ys.flatten(), xs.flatten()
    dy = (ys[None, :] - ys[:, None]) % H
    dx = (xs[None, :] - xs[:, None]) % W
    return dy * W + dx


def bccb_project(attn: Tensor, hw: tuple[int, int]) -> Tensor:
    """Orthogonal (Frobenius) projection of (..., N, N) matrices onto the BCCB matrices of an H x W grid.

    A BCCB matrix's entry (i, j) depends only on the torus offset j - i, so the nearest one averages
    the N entries sharing each offset (the wrapped 2-D diagonals). Works for non-square grids.
    """
    H, W = hw
    N = H * W
    if attn.dim() < 2 or attn.shape[-1] != N or attn.shape[-2] != N:
        raise ValueError(f"bccb_project expects (..., {N}, {N}) for hw={tuple(hw)}; got {tuple(attn.shape)}")
    offset = _torus_offset_index(hw, attn.device)
    flat = attn.reshape(*attn.shape[:-2], N * N)
    index = offset.flatten().expand_as(flat)
    diag_mean = torch.zeros(*attn.shape[:-2], N, dtype=attn.dtype, device=attn.device)
    diag_mean = diag_mean.scatter_add(-1, index, flat) / N
    return diag_mean[..., offset]


def circulant_attention_flops(num_tokens: int, channels: int, head_dim: int = 1) -> int:
    """Multiply-accumulates of circulant attention as the paper counts them.

    Per head of dim d over N tokens: N * log2(N) * (4d + 2) + 4 * N * d.
    """
    heads = channels // head_dim
    n = num_tokens
    return round(heads * (n * math.log2(n) * (4 * head_dim + 2) + 4 * n * head_dim))


def set_fft_backend(model: nn.Module, backend: FFTBackend) -> nn.Module:
    """Switch every :class:`CirculantAttention` in ``model`` (and ``cat.convert``'s attention) to ``backend``;
    returns ``model``."""
    check_backend(backend)
    for module in model.modules():
        if isinstance(module, CirculantAttention) or hasattr(module, "fft_backend"):
            cast(Any, module).fft_backend = backend  # cat.convert's attention too
    return model


def set_attention_kernel(model: nn.Module, kernel: KernelPolicy) -> nn.Module:
    """Run every :class:`CirculantAttention` in ``model`` (and ``cat.convert``'s attention) through the Triton kernels
    (``'triton'``: wherever Triton runs, its interpreter on a CPU included), the ATen path (``'aten'``), or by device
    and grid (``'auto'``: :func:`cat.ops.policy.kernel_for`); returns ``model``."""
    check_kernel(kernel)
    for module in model.modules():
        if isinstance(module, CirculantAttention) or hasattr(module, "attention_kernel"):
            cast(Any, module).attention_kernel = kernel  # cat.convert's attention too
    return model


def set_lean_attention(model: nn.Module, lean: LeanPolicy) -> nn.Module:
    """Train every :class:`CirculantAttention` in ``model`` through the lean function (``True``: less memory), with
    its spectra stored (``False``: faster steps, more memory), or by device and size (``'auto'``:
    :func:`cat.ops.policy.lean_for`); returns ``model``."""
    lean = check_lean(lean)
    for module in model.modules():
        if isinstance(module, CirculantAttention) or hasattr(module, "lean"):
            cast(Any, module).lean = lean  # cat.convert's attention too
    return model


def set_attention_memory(model: nn.Module, memory_mb: int | None) -> nn.Module:
    """Give every :class:`CirculantAttention` in ``model`` (and ``cat.convert``'s attention) a memory budget of
    ``memory_mb`` MiB (None: a share of the device's free memory, :mod:`cat.ops.policy`): the lean function's
    working set per channel group, and what ``lean='auto'`` lets stored spectra take; returns ``model``."""
    if memory_mb is not None and (isinstance(memory_mb, bool) or not isinstance(memory_mb, int) or memory_mb < 1):
        raise ValueError(f"the attention memory budget must be a positive number of MiB or None; got {memory_mb!r}")
    for module in model.modules():
        if isinstance(module, CirculantAttention) or hasattr(module, "memory_mb"):
            cast(Any, module).memory_mb = memory_mb  # cat.convert's attention too
    return model


def configure_attention(
    model: nn.Module,
    lean: LeanPolicy,
    fft_backend: FFTBackend,
    memory_mb: int | None,
    kernel: KernelPolicy = "auto",
) -> nn.Module:
    """:func:`set_lean_attention`, :func:`set_fft_backend`, :func:`set_attention_memory` and
    :func:`set_attention_kernel` at once (the ``model.lean_attention``, ``model.fft_backend``,
    ``model.attention_memory_mb`` and ``model.attention_kernel`` keys); returns ``model``."""
    set_attention_memory(set_fft_backend(set_lean_attention(model, lean), fft_backend), memory_mb)
    return set_attention_kernel(model, kernel)
