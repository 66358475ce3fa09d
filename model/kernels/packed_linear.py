"""Each model's decode twin: the same modules and weights, its linear layers on weights packed for the CPU kernel.

The compiled CPU decode steps (model/decode/compiled/decoder.py) run the twin, not the
model: every nn.Linear becomes a `PackedLinear`, which calls
`torch.ops.rnnserve.packed_linear` (model/kernels/packed_linear.cpp) on a copy
of its weight packed once, and shares its bias. Everything else (embeddings,
norms, attention buffers) is the model's own tensors. The model's math files
stay as they are, and eager steps, prefill and training keep PyTorch's linear
layers. The packed copies are a snapshot: a model changed in place after its
twin was made would decode with its old weights, which serving never does.

One twin per model, made on first use and dropped with the model, so that all
its decoders (a server's engine, each `generate` call) share it and the graphs
compiled for it.
"""

from __future__ import annotations

import copy
import weakref

import torch
from torch import nn

from .loader import bf16_dense_rows, packed_linear_wins
from ..output_heads import TiedHead
from ..transformer import Transformer


def _pack(weight: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """A layer's weight (out, in) packed for the kernel; its `out` features; and `dense_rows`, above how many rows
    the kernel hands a bfloat16 product to PyTorch's (`bf16_dense_rows`; 0 for float32: the kernel takes them all)."""
    with torch.inference_mode(False), torch.no_grad():  # a plain tensor, whatever mode the twin is made in
        packed: torch.Tensor = torch.ops.rnnserve.pack_linear_weight(weight.detach())
    dense_rows = bf16_dense_rows() if weight.dtype == torch.bfloat16 else 0
    return packed, weight.shape[0], dense_rows


class PackedLinear(nn.Module):
    """`linear(x)` as the CPU kernel computes it: x W^T + b, W packed once (float32 or bfloat16, CPU). A bfloat16
    layer sums in float32 and rounds once, as PyTorch's does; above `dense_rows` rows (where the CPU's matrix
    units make PyTorch's product the faster) the kernel calls PyTorch's product on the model's own weight."""

    packed: torch.Tensor  # a buffer: the kernel's layout of the weight

    def __init__(self, linear: nn.Linear):
        super().__init__()
        packed, self.out_features, self.dense_rows = _pack(linear.weight)
        self.register_buffer("packed", packed)
        self.bias = linear.bias  # the model's own parameter
        # The model's own weight too, for modules that read it rather than call the layer (the mixture head
        # projects in float32 through F.linear): they compute with it, unpacked, as the model does.
        self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        return packed_product(x, self.packed, self.bias, self.out_features, self.weight, self.dense_rows)


class PackedTiedHead(TiedHead):
    """A bfloat16 tied head (logits from the embedding's matrix) on the packed kernel: at a decode step's few rows
    it reads the largest matrix of a small model, which PyTorch's bfloat16 product reads at a fraction of the
    kernel's pace. The embedding keeps its own matrix; the packed copy is the twin's."""

    packed: torch.Tensor  # a buffer: the kernel's layout of the embedding's matrix

    def __init__(self, head: TiedHead):
        super().__init__(head._embedding[0])
        packed, self.out_features, self.dense_rows = _pack(head._embedding[0].weight)  # of the (V, d_model) matrix
        self.register_buffer("packed", packed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., d_model) -> (..., V)
        return packed_product(x, self.packed, None, self.out_features, self._embedding[0].weight, self.dense_rows)


def packed_product(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, n: int, weight: torch.Tensor, dense_rows: int
) -> torch.Tensor:
    """x (..., in) -> (..., n) on the packed kernel; with dense_rows > 0, PyTorch's product of `weight` for more rows."""
    if dense_rows:
        y: torch.Tensor = torch.ops.rnnserve.packed_linear_or_dense(x, packed, bias, n, weight, dense_rows)
    else:
        y = torch.ops.rnnserve.packed_linear(x, packed, bias, n)
    return y


class DecodeTwins:
    """One decode twin per live model."""

    def __init__(self) -> None:
        self._per_model: weakref.WeakKeyDictionary[Transformer, Transformer] = weakref.WeakKeyDictionary()

    def __call__(self, model: Transformer) -> Transformer:
        twin = self._per_model.get(model)
        if twin is None:
            twin = self._per_model[model] = make_twin(model)
        return twin


def packs(model: nn.Module) -> bool:
    """Whether the kernel takes this model's linear layers: float32 or bfloat16, on a CPU route where it beats
    PyTorch's products (`packed_linear_wins`: AVX-512 and AVX2) or on a forced one."""
    weight = next(model.parameters())
    packable = weight.dtype in (torch.float32, torch.bfloat16)
    return packable and weight.device.type == "cpu" and packed_linear_wins()


def make_twin(model: Transformer) -> Transformer:
    """A structural copy of `model` that shares its parameters and buffers, with its nn.Linear layers packed (and,
    in bfloat16, its tied head)."""
    shared = {id(t): t for t in (*model.parameters(), *model.buffers())}  # deepcopy's memo: keep these as they are
    twin = copy.deepcopy(model, shared)
    for parent in list(twin.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, PackedLinear(child))
            elif isinstance(child, TiedHead) and child._embedding[0].weight.dtype == torch.bfloat16:
                setattr(parent, name, PackedTiedHead(child))
    return twin


decode_twin = DecodeTwins()  # process-wide: a model's decoders must all find its one twin
