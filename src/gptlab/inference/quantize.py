"""Int8 weight-only quantisation: decoding with a quarter of the weight bytes (issue 15).

Batch-1 decoding reads every weight once per new token, so its speed is bounded by memory bandwidth
/ weight bytes (benchmarks/generate.py). `quantize_int8` stores every nn.Linear weight, the vocabulary
head included, as int8 with one float scale per output channel (symmetric: w ~ q * s with
s = max|w_row| / 127 and q in [-127, 127]); activations stay floating point. A tied head is
quantised as a head, and the token embedding it shared stays float32 for the input rows.

Kernel, measured on a 2-core Xeon with AVX512-BF16 (torch 2.13 CPU, one thread, microseconds per
product of one row; the README's "int8 weights" has the full table):

    shape (in x out)   float32   int8pack, bf16 x   int8pack, fp32 x   dequantise + fp32 linear
    768 x 3072           375            143              1,549                868
    768 x 50257        9,001          2,542             31,148             71,107

`torch.ops.aten._weight_int8pack_mm` with bfloat16 activations is the one weight-only kernel in torch that
beats float32, so the activations entering a product are rounded to bfloat16 and its output (rounded to
bfloat16 by the kernel) goes back to the model's float32. From about 16 rows on (a prefill, an
evaluation batch) it loses to dequantising the weight to bfloat16 once and calling the ordinary
matmul, so `Int8Linear` picks one of the two by the number of rows. torch.ao's dynamic quantisation is
as fast, but it quantises the activations to int8 too, so it is not weight-only and is not used.
torch.compile of "cast the int8 weight, then matmul" was 4 to 10 times slower than the kernel.

Deliberate deviation: each product's output is rounded to bfloat16, so the cached and recomputed
decoders of an int8 model agree to a few bfloat16 steps, not to float32's 1e-5 (tests/test_quantize.py).
`activations=torch.float32` multiplies the same int8 weights in float32, where they agree to 1e-5; it
saves memory but not time, and is the reference the tests and the perplexity figures use beside it.

Surprise, flagged: in torch 2.13 `_weight_int8pack_mm` on the CPU needs in_features % 16 == 0; other
widths return garbage or crash the process, so such layers always take the dequantising path.
"""

from __future__ import annotations

from typing import TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from gptlab.config import DTYPES, QUANTIZATIONS, SettingError

PACKED_MAX_ROWS = 16  # up to this many rows the int8 kernel is faster than dequantise + matmul
PACKED_WIDTH_MULTIPLE = 16  # the int8 kernel's in_features must be a multiple of this
M = TypeVar("M", bound=nn.Module)  # the functions below change a model in place and return it


def bf16_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest bfloat16 value >= each positive float32 of x, as float32.

    bfloat16 is float32 with the low 16 bits dropped, so rounding those bits up is exact.
    """
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0xFFFF) & ~0xFFFF).view(torch.float32)


def quantize_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: weight (out, in) -> q (out, in) int8 and scales (out,) float32.

    Each scale is max|w_row| / 127 rounded up to a bfloat16 value, so the kernel's bfloat16 scales are
    exact and |q| <= 127 still holds; an all-zero row gets scale 1 (any scale represents it).
    """
    w = weight.detach().float()
    largest = w.abs().amax(dim=1)  # (out,)
    tiny = torch.finfo(torch.float32).tiny  # a normal float32, hence also a normal bfloat16
    scales = bf16_ceil(torch.where(largest > 0, (largest / 127).clamp_min(tiny), torch.ones_like(largest)))
    q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)  # (out, in)
    return q.contiguous(), scales


class Int8Linear(nn.Module):
    """y = x (q * s)^T + b with int8 q (out, in) and per-output-channel scales s: inference only.

    `activations` is what x is multiplied in: bfloat16 (the fast kernel; the product is rounded to
    bfloat16, about 3 significant digits, before it returns to float32) or float32 (the same weights
    multiplied exactly as a float32 layer would: a quarter of the memory, but no faster).
    """

    weight: torch.Tensor  # buffers, not parameters: nothing here is trained
    scales: torch.Tensor
    bias: torch.Tensor | None

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None,
                 activations: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        if activations not in (torch.bfloat16, torch.float32):
            raise ValueError(f"activations={activations} must be torch.bfloat16 or torch.float32")
        self.in_features, self.out_features = weight.size(1), weight.size(0)
        self.register_buffer("weight", weight)  # (out, in) int8, row-major as the kernel reads it
        self.register_buffer("scales", scales.to(torch.bfloat16))  # (out,), exact: see quantize_rows
        self.register_buffer("bias", None if bias is None else bias.detach().clone())  # float, (out,)
        self.activations = activations
        # Chosen once: the int8 kernel where it computes the right thing (bfloat16, a width it takes)
        self.packed = activations == torch.bfloat16 and self.in_features % PACKED_WIDTH_MULTIPLE == 0

    @classmethod
    def from_linear(cls, linear: nn.Linear, activations: torch.dtype = torch.bfloat16) -> Int8Linear:
        """Quantise an nn.Linear's weight (any memory layout); its bias is kept as it is."""
        q, scales = quantize_rows(linear.weight)
        return cls(q, scales, linear.bias, activations)

    def dequantized(self) -> torch.Tensor:
        """The float32 weight (out, in) = q * s that this layer multiplies by."""
        return self.weight.float() * self.scales.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        rows = x.reshape(-1, self.in_features).to(self.activations).contiguous()  # (N, in)
        if self.packed and rows.size(0) <= PACKED_MAX_ROWS:  # decoding: read one byte per weight
            y = torch.ops.aten._weight_int8pack_mm(rows, self.weight, self.scales)  # (N, out)
        else:  # many rows, or float32: one dequantised copy serves them all, scaled per channel after
            y = F.linear(rows, self.weight.to(self.activations)).float() * self.scales.float()
        y = y.view(*x.shape[:-1], self.out_features)
        if self.bias is None:
            return y.to(x.dtype)
        return self.bias + y  # back to the bias's (the model's) dtype by type promotion, in one pass

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, activations={self.activations}, int8 kernel={self.packed}")


def quantize_int8(model: M, activations: torch.dtype = torch.bfloat16) -> M:
    """Replace every nn.Linear of `model` (in place) by an Int8Linear, and return it in eval mode.

    Meant for the CPU (see `quantize`); a tied head is quantised like any other head, and the embedding
    keeps its own float tensor. `activations=torch.float32` gives the exact-arithmetic reference.
    """
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear.from_linear(child, activations))
    return model.eval()


def quantize(model: M, method: str) -> M:
    """Apply a quantisation by name (`none` or `int8`), the entry point of the commands.

    int8 runs on the CPU only: its kernel was chosen and tested there, and on other devices the
    dequantising path would save memory but not time.
    """
    if method not in QUANTIZATIONS:
        raise ValueError(f"quantize={method!r} is not one of {', '.join(QUANTIZATIONS)}")
    if method == "none":
        return model
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise SettingError(f"{{quantize}} int8 runs on the CPU only, not on {device}: use {{device}} cpu, "
                           "or {quantize} none", quantize="quantize", device="device")
    return quantize_int8(model)


def inference_weights(model: M, dtype: str, method: str) -> M:
    """Hold a model's weights in `dtype` or quantised by `method`: float32, bfloat16 (half the memory) or
    int8 (a quarter; it takes float32 weights and multiplies in bfloat16 itself)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype != "float32" and method != "none":
        raise SettingError(f"{{dtype}} {dtype} and {{quantize}} {method} both set the weights' precision: "
                           "choose one", dtype="dtype", quantize="quantize")
    return quantize(model.to(getattr(torch, dtype)), method)
