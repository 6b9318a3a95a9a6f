"""QLoRA's frozen base: each adapted layer's weight held in 4-bit NF4 by torchao.

NF4 stores blocks of 64 weights as 4-bit codes of a normal-quantile table with one scale per
block, the scales themselves quantised to 8 bits in groups (double quantisation): about 4.1
bits per weight instead of 32. The forward dequantises on the fly into the input's dtype.

The weight becomes an NF4Tensor in apply_tuning, on the meta device, before FSDP2 shards it:
FSDP2 then shards it on dim 0 and all-gathers the packed codes and scales (torchao implements
fsdp_pre_all_gather / fsdp_post_all_gather), never a dense weight. The values arrive later
through kiln.parallel.dtensor.copy_full_into, which calls `load_whole` here: the whole weight
is quantised and each rank keeps its rows of the result, so a sharded base holds exactly the
codes and scales of the unsharded one (torchtune's QLoRA + FSDP2 recipe does the same).
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from kiln.errors import KilnError

BLOCK = 64
"""Weights per NF4 block (one scale each), as in the QLoRA paper."""
SCALER_BLOCK = 256
"""Block scales per second-level group (the paper's 256); fewer for small layers."""
SPLITS = 8
"""Groups are chosen, where the layer is big enough, so that their number divides by 8: the
weight then splits over 2, 4 or 8 FSDP2 ranks at group boundaries with the same groups as in
one process (the grouping never depends on the number of ranks)."""
_NF4_MODULE = "torchao.quantization.quantize_.workflows.nf4.nf4_tensor"


def scaler_block(n_blocks: int) -> int:
    """Block scales per group for a weight of n_blocks blocks: the largest power of two up to
    SCALER_BLOCK giving a number of groups divisible by SPLITS, or else merely dividing n_blocks."""
    def largest(splits: int) -> int:
        scaler = SCALER_BLOCK
        while scaler > 1 and n_blocks % (scaler * splits):
            scaler //= 2
        return scaler

    return largest(SPLITS) if largest(SPLITS) > 1 else largest(1)


def to_nf4(weight: torch.Tensor) -> torch.Tensor:
    """The weight as an NF4Tensor (dequantised by `.get_original_weight()`); on the meta
    device, an NF4Tensor of the right layout to load into later."""
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4 as torchao_to_nf4

    n_blocks, rest = divmod(weight.numel(), BLOCK)
    if rest:
        raise KilnError(f"peft.method qlora: a weight of shape {list(weight.shape)} has "
                        f"{weight.numel()} elements, not a multiple of the NF4 block ({BLOCK})")
    return torchao_to_nf4(weight.detach().contiguous(), BLOCK, scaler_block(n_blocks))


def is_nf4(t: torch.Tensor) -> bool:
    """True for an NF4Tensor (without importing torchao when nothing has)."""
    module = sys.modules.get(_NF4_MODULE)
    return module is not None and isinstance(t, module.NF4Tensor)


@torch.no_grad()
def quantize_base(model: nn.Module, shards: int = 1) -> None:
    """Replace the base weight of every adapter layer but lm_head and embed by its NF4 form, in
    place (on the meta device: the layout only). `shards`: the FSDP2 ranks the weight will be split over; each
    must get whole rows and whole groups of block scales, or this is a KilnError."""
    from kiln.peft.lora import adapter_layers

    for name, layer in adapter_layers(model):
        if name in ("lm_head", "embed"):  # kept in full precision, as bitsandbytes keeps them
            continue
        nf4 = to_nf4(layer.weight)
        rows, groups = nf4.shape[0], nf4.quantization_factor.numel()
        if shards > 1 and (rows % shards or groups % shards):
            raise KilnError(
                f"peft.method qlora with dp_shard={shards}: {name}.weight {list(nf4.shape)} does "
                f"not split evenly over {shards} FSDP2 ranks (its {rows} rows and its {groups} "
                f"groups of NF4 block scales must both divide by {shards}); use a dp_shard "
                f"that divides both (2, 4 or 8 do for layers of {BLOCK * SCALER_BLOCK * SPLITS} "
                "weights or more whose rows divide by it)")
        layer.weight = nn.Parameter(nf4, requires_grad=False)
        layer.nf4 = True


_PARTS = ("quantized_data", "quantized_scalers", "quantization_factor", "scaler_mean", "nf4")
"""An NF4Tensor's inner tensors: codes, block scales, their group factors and mean, the table."""


@torch.no_grad()
def load_whole(target: torch.Tensor, full: torch.Tensor, index: int = 0, count: int = 1) -> None:
    """Quantise `full` (the whole weight) and put it, or its `index`-th of `count` row chunks
    (this rank's FSDP2 shard), into the NF4Tensor `target` in place.

    In place by swapping the target's inner tensors: after to_empty an NF4Tensor has fresh
    codes and scales but still its meta-device mean and table, which copy_ would not replace.
    """
    whole = to_nf4(full.to(target.device, target.dtype))
    if (whole.block_size, whole.scaler_block_size) != (target.block_size, target.scaler_block_size):
        raise AssertionError("an NF4 weight loaded with another block layout than it was built with")
    part = torch.chunk(whole, count, dim=0)[index] if count > 1 else whole
    if part.shape != target.shape:
        raise AssertionError(f"NF4 shard {list(part.shape)} for a target of {list(target.shape)}")
    for name in _PARTS:
        setattr(target, name, getattr(part, name))
