"""Tensor parallel with sequence parallel, on the reshaped transformer's blocks.

Inside a block (torchtitan's plan): q/k/v and gate/up are split by columns (whole heads per
rank), o and down by rows. Between them the residual stream is split along the sequence
(sequence parallel): the norms run on each rank's slice of the tokens, attention and the MLP
all-gather the sequence on entry, and o/down reduce-scatter back to slices on exit. So the
activations between blocks cost 1/tp of their memory, and the traffic is the same as plain
tensor parallel (an all-reduce is a reduce-scatter plus an all-gather).

A layer that says where its parameters go (`tp_placements(style)`, as a LoRA layer does: its
A and B split to match the base weight) is split that way by the same styles; a plain
nn.Linear as torch's ColwiseParallel / RowwiseParallel split it.

The embedding, final norm and output projection stay whole on every tensor-parallel rank
(FSDP2 still shards them over the data-parallel ranks): the loss runs the head in chunks
(kiln.train.loss) on a whole hidden state. The region is entered at a model's first block
(a slice, no communication) and left after its last (an all-gather), so a pipeline stage,
which holds some of the blocks, is a region of its own.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Placement, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                               PrepareModuleInputOutput, PrepareModuleOutput,
                                               RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from kiln.models.moe import MoE


def _place(placements: dict[str, Placement]):
    """A distribute_module partition function: each parameter of the layer and of its
    submodules (named relative to the layer) to its placement."""
    def partition(name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for local, param in list(module.named_parameters(recurse=False)):
            placement = placements[f"{name}.{local}" if name else local]
            module.register_parameter(local, nn.Parameter(
                distribute_tensor(param, mesh, [placement]), requires_grad=param.requires_grad))
    return partition


class _Declared:
    """For torch's ColwiseParallel / RowwiseParallel: a layer with tp_placements(style) (an
    adapter over a linear layer) is split as it says, with the style's input and output."""

    style: str

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not hasattr(module, "tp_placements"):
            return super()._apply(module, device_mesh)
        if self.style == "rowwise":
            self.desired_input_layouts = (Shard(-1),)  # what RowwiseParallel sets for a Linear
        return distribute_module(
            module, device_mesh, _place(module.tp_placements(self.style)),
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Colwise(_Declared, ColwiseParallel):
    style = "colwise"


class Rowwise(_Declared, RowwiseParallel):
    style = "rowwise"


def block_plan(qk_norm: bool, moe: bool = False) -> dict:
    """One block's plan. Its inputs are (x, cos, sin, mask): only x is split.

    moe: the block's MLP is a mixture of experts, which stays whole on every tensor-parallel
    rank (replicated, or split over the expert-parallel ranks): it runs on the whole sequence,
    gathered on entry, and each rank keeps its slice of the output (no communication; the
    gradient is gathered in backward, so every rank's MoE weights get the whole gradient).
    """
    if moe:
        mlp = {"mlp": PrepareModuleInputOutput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_input=True,
            output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),), use_local_output=True)}
    else:
        mlp = {
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                      use_local_output=True),
            "mlp.gate": Colwise(), "mlp.up": Colwise(), "mlp.down": Rowwise(output_layouts=Shard(1)),
        }
    plan = {
        "attn_norm": SequenceParallel(),
        "attn": PrepareModuleInput(input_layouts=(Shard(1), None, None, None),
                                   desired_input_layouts=(Replicate(), None, None, None),
                                   use_local_output=True),
        "attn.q": Colwise(), "attn.k": Colwise(), "attn.v": Colwise(),
        "attn.o": Rowwise(output_layouts=Shard(1)),
        "mlp_norm": SequenceParallel(),
        **mlp,
    }
    if qk_norm:
        # Per-head norms on (batch, seq, local heads, head_dim): each rank holds some heads, so
        # the shared weight's gradient is a sum over ranks. Marking the heads dimension as
        # sharded (the norm is per head, so that is exact) makes DTensor add those up.
        plan["attn.q_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        plan["attn.k_norm"] = SequenceParallel(sequence_dim=2, use_local_output=True)
    return plan


def apply_tensor_parallel(model: nn.Module, tp_mesh: DeviceMesh) -> None:
    # SequenceParallel makes new parameters of the norms' weights, trainable ones: a frozen
    # base (fine-tuning with adapters) must stay frozen.
    frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
    blocks = list(model.layers.values())
    for block in blocks:
        parallelize_module(block, tp_mesh, block_plan(model.cfg.qk_norm, isinstance(block.mlp, MoE)))
    enter = dict(input_layouts=(Replicate(), None, None, None),
                 desired_input_layouts=(Shard(1), None, None, None))
    leave = dict(output_layouts=Shard(1), desired_output_layouts=Replicate(), use_local_output=True)
    first, last = blocks[0], blocks[-1]
    if first is last:
        parallelize_module(first, tp_mesh, PrepareModuleInputOutput(**enter, use_local_input=True, **leave))
    else:
        parallelize_module(first, tp_mesh, PrepareModuleInput(**enter, use_local_output=True))
        parallelize_module(last, tp_mesh, PrepareModuleOutput(**leave))
    for name, p in model.named_parameters():
        if name in frozen:
            p.requires_grad_(False)
    pad_sequence_to_multiple(model, tp_mesh.size())


def pad_sequence_to_multiple(model: nn.Module, multiple: int) -> None:
    """Sequence parallel splits the sequence evenly: a shorter or odd input (a prompt being
    sampled from) is padded at the end and the output cut back. Attention is causal, so the
    padding changes nothing at the real positions. Training batches need no padding when
    data.seq_len is a multiple of tp."""

    def pad(module, args, kwargs):
        tokens = args[0] if args else kwargs["tokens"]
        extra = -tokens.shape[1] % multiple
        if not extra:
            return None
        module._kiln_unpadded = tokens.shape[1]
        pad_rows = (lambda t, value=0: None if t is None else
                    F.pad(t, (0, 0) * (t.ndim - 2) + (0, extra), value=value))
        args = (pad_rows(tokens), *args[1:]) if args else args
        kwargs = {k: pad_rows(v, -1 if k == "document_ids" else 0) if isinstance(v, torch.Tensor)
                  else v for k, v in kwargs.items()}
        if not args:
            kwargs["tokens"] = pad_rows(tokens)
        return args, kwargs

    def cut(module, args, kwargs, output):
        length = module.__dict__.pop("_kiln_unpadded", None)
        return output if length is None else output[:, :length]

    model.register_forward_pre_hook(pad, with_kwargs=True)
    model.register_forward_hook(cut, with_kwargs=True)
