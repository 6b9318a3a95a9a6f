"""QLoRA's frozen base: each adapted layer's weight held in 4-bit NF4 by torchao.

NF4 stores blocks of 64 weights as 4-bit codes of a normal-quantile table with one scale per
block, the scales themselves quantised to 8 bits (double quantisation): about 4.1 bits per
weight instead of 32. The forward dequantises on the fly into the input's dtype.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from kiln.errors import KilnError
from kiln.peft.lora import adapter_layers

BLOCK = 64
"""Weights per NF4 block (one scale each), as in the QLoRA paper."""
SCALER_BLOCK = 256
"""Block scales per second-level scale; smaller for small layers (it must divide their count)."""


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """The weight as an NF4Tensor (dequantised by `.get_original_weight()`)."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4 as torchao_to_nf4

    n_blocks, rest = divmod(weight.numel(), BLOCK)
    if rest:
        raise KilnError(f"peft.method qlora: a weight of shape {list(weight.shape)} has "
                        f"{weight.numel()} elements, not a multiple of the NF4 block ({BLOCK})")
    scaler = SCALER_BLOCK
    while n_blocks % scaler:
        scaler //= 2
    return torchao_to_nf4(weight.detach().contiguous(), BLOCK, scaler)


@torch.no_grad()
def quantize_base(model: nn.Module) -> None:
    """Replace the base weight of every adapter layer by its NF4 form, in place."""
    for name, layer in adapter_layers(model):
        if isinstance(layer.weight, DTensor):
            raise KilnError(f"peft.method qlora: {name}.weight is sharded; QLoRA runs unsharded")
        layer.weight = nn.Parameter(to_nf4(layer.weight), requires_grad=False)
        layer.nf4 = True
