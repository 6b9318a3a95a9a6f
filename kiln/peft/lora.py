"""LoRA, DoRA and QLoRA layers: a frozen linear layer plus a trainable low-rank update.

Computed as Hugging Face PEFT computes them (the same initialisation, scaling, dropout and
DoRA norm), so an adapter trained here gives PEFT's outputs when loaded there.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard

from kiln.config import JobConfig, PeftConfig
from kiln.errors import KilnError
from kiln.launch.layout import Layout
from kiln.parallel.dtensor import copy_full_into, full_tensor

# Where each target lives in a block: attention or MLP.
TARGETS = {"q": "attn", "k": "attn", "v": "attn", "o": "attn", "gate": "mlp", "up": "mlp", "down": "mlp"}
ADAPTER_PARAMS = ("lora_A.weight", "lora_B.weight", "lora_magnitude_vector", "lora_embedding_A",
                  "lora_embedding_B")


def is_adapter_name(name: str) -> bool:
    """True for the parameters an adapter adds (their names end in ADAPTER_PARAMS)."""
    return name.endswith(ADAPTER_PARAMS)


class LoRALinear(nn.Module):
    """y = x W^T + b + s * B(A(dropout(x))), W and b frozen; s = alpha / r (alpha / sqrt(r) with
    rsLoRA). With DoRA, each output row is rescaled to a trained magnitude m:
    y = m / ||W + s B A||_row * (x W^T + s * B(A(x))) + b, the norm detached as in the paper.

    The base keeps its own names (`attn.q.weight`, `attn.q.bias`), so the base part of the state
    dict is the plain model's; the adapter adds `lora_A.weight`, `lora_B.weight` and, for DoRA,
    `lora_magnitude_vector`, which are PEFT's names for the same tensors.
    """

    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0,
                 rslora: bool = False, dora: bool = False):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.weight.requires_grad_(False)
        if self.bias is not None:
            self.bias.requires_grad_(False)
        device = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=device)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=device)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        magnitude = nn.Parameter(torch.empty(self.out_features, device=device)) if dora else None
        self.register_parameter("lora_magnitude_vector", magnitude)
        self.nf4 = False
        """True once the base weight is an NF4Tensor (QLoRA)."""

    def tp_placements(self, style: str) -> dict[str, Placement]:
        """Where each parameter goes under tensor parallel (kiln.parallel.tensor_parallel).
        colwise (q/k/v/gate/up: output features split): W, b, B and the magnitude by rows, A
        whole, so each rank computes its slice of both paths. rowwise (o/down: input features
        split): W and A by columns, B, b and the magnitude whole; the base's and B(A x)'s partial
        sums are added up by the layer's output reduction, as the base's alone would be."""
        if style == "colwise":
            return {"weight": Shard(0), "bias": Shard(0), "lora_magnitude_vector": Shard(0),
                    "lora_A.weight": Replicate(), "lora_B.weight": Shard(0)}
        return {"weight": Shard(1), "bias": Replicate(), "lora_magnitude_vector": Replicate(),
                "lora_A.weight": Shard(1), "lora_B.weight": Replicate()}

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.nf4:
            return F.linear(x, self.weight, self.bias)
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import linear_nf4

        # Dequantises block by block into x's dtype; the backward needs no weight gradient.
        y = linear_nf4(x, self.weight)
        return y if self.bias is None else y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        result = self.base_forward(x)
        dx = self.dropout(x)
        lora = self.lora_B(self.lora_A(dx))
        if self.lora_magnitude_vector is None:
            return result + lora * self.scaling
        return result + self._dora(x, dx, result, lora)

    def _dora(self, x: torch.Tensor, dx: torch.Tensor, result: torch.Tensor,
              lora: torch.Tensor) -> torch.Tensor:
        """What DoRA adds to the base output (PEFT's DoraLinearLayer.forward)."""
        weight = self.dense_weight().to(x.dtype)
        delta = (self.lora_B.weight @ self.lora_A.weight).to(x.dtype)
        # ||W + s BA|| is treated as a constant (DoRA paper, section 4.3): no gradient through it.
        norm = torch.linalg.norm(weight + self.scaling * delta.detach(), dim=1).detach()
        scale = (self.lora_magnitude_vector / norm).view(1, -1)
        if isinstance(self.dropout, nn.Identity) or not self.training:
            base = result if self.bias is None else result - self.bias
        else:  # with dropout the rescaled base path sees the dropped-out input, as in PEFT
            base = F.linear(dx, weight)
        return (scale - 1) * base + scale * lora * self.scaling

    def dense_weight(self) -> torch.Tensor:
        """The base weight as a plain tensor (dequantised for QLoRA; a DTensor stays one)."""
        if not self.nf4:
            return self.weight
        if isinstance(self.weight, DTensor):  # FSDP2's shard, between forwards: its rows
            w = self.weight
            return DTensor.from_local(w.to_local().get_original_weight(), w.device_mesh,
                                      w.placements, shape=w.shape, stride=w.stride())
        return self.weight.get_original_weight()

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """W + s BA (DoRA: rescaled to the magnitude per row), in fp32: the weight of one plain
        linear layer that computes what this one does (without dropout)."""
        weight = full_tensor(self.dense_weight()).float()
        delta = full_tensor(self.lora_B.weight).float() @ full_tensor(self.lora_A.weight).float()
        merged = weight + self.scaling * delta
        if self.lora_magnitude_vector is not None:
            magnitude = full_tensor(self.lora_magnitude_vector).float()
            merged = (magnitude / torch.linalg.norm(merged, dim=1)).unsqueeze(1) * merged
        return merged

    @torch.no_grad()
    def init_adapter(self, seed: int, name: str) -> None:
        """A as nn.Linear's default (Kaiming-uniform, bound 1/sqrt(in)), B zero, so the layer
        starts as the base; DoRA's magnitude starts as the base's row norms. A is drawn whole
        from a generator seeded by (seed, name): the same on every rank and sharding."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        bound = 1 / math.sqrt(self.in_features)
        a = torch.empty(tuple(self.lora_A.weight.shape)).uniform_(-bound, bound, generator=gen)
        copy_full_into(self.lora_A.weight, a)
        copy_full_into(self.lora_B.weight, torch.zeros(tuple(self.lora_B.weight.shape)))
        if self.lora_magnitude_vector is not None:
            norm = torch.linalg.norm(full_tensor(self.weight).float(), dim=1)
            copy_full_into(self.lora_magnitude_vector, norm)

    def extra_repr(self) -> str:
        kind = "dora" if self.lora_magnitude_vector is not None else "lora"
        return (f"{self.in_features}, {self.out_features}, {kind}, rank={self.lora_A.out_features}, "
                f"scaling={self.scaling:g}{', nf4' if self.nf4 else ''}")


class LoRAEmbedding(nn.Module):
    """An embedding lookup plus a low-rank update: E[x] + s * (A^T[x] B^T), E frozen (and still
    the output layer's weight when tied: the update changes the lookup only). PEFT's LoRA
    Embedding, with its names and shapes: lora_embedding_A (r x vocab), lora_embedding_B
    (dim x r), A starting at zero and B normal, so the layer starts as the base."""

    def __init__(self, base: nn.Embedding, rank: int, alpha: float, rslora: bool = False):
        super().__init__()
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.weight = base.weight
        self.weight.requires_grad_(False)
        device = base.weight.device
        self.lora_embedding_A = nn.Parameter(torch.empty(rank, self.num_embeddings, device=device))
        self.lora_embedding_B = nn.Parameter(torch.empty(self.embedding_dim, rank, device=device))
        self.scaling = alpha / math.sqrt(rank) if rslora else alpha / rank
        self.nf4 = False

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        update = F.embedding(tokens, self.lora_embedding_A.T) @ self.lora_embedding_B.T
        return F.embedding(tokens, self.weight) + update * self.scaling

    @torch.no_grad()
    def merged_weight(self) -> torch.Tensor:
        """E + s (B A)^T in fp32."""
        delta = full_tensor(self.lora_embedding_B).float() @ full_tensor(self.lora_embedding_A).float()
        return full_tensor(self.weight).float() + self.scaling * delta.T

    @torch.no_grad()
    def init_adapter(self, seed: int, name: str) -> None:
        """A zero, B standard normal (PEFT's initialisation for embeddings), B drawn whole from a
        generator seeded by (seed, name)."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        copy_full_into(self.lora_embedding_A, torch.zeros(tuple(self.lora_embedding_A.shape)))
        copy_full_into(self.lora_embedding_B,
                       torch.empty(tuple(self.lora_embedding_B.shape)).normal_(generator=gen))

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, lora, "
                f"rank={self.lora_embedding_A.shape[0]}, scaling={self.scaling:g}")


def adapter_layers(model: nn.Module) -> list[tuple[str, LoRALinear | LoRAEmbedding]]:
    return [(name, m) for name, m in model.named_modules() if isinstance(m, (LoRALinear, LoRAEmbedding))]


def apply_tuning(model: nn.Module, cfg: JobConfig, shards: int = 1) -> nn.Module:
    """Freeze the base and wrap the target linear layers of every block (in place, on any
    device, meta too; before parallelize). For QLoRA the base weights become NF4Tensors (on
    the meta device: their layout, filled when the weights are loaded), to be split over
    `shards` FSDP2 ranks. A no-op for peft.method full."""
    pcfg: PeftConfig = cfg.peft
    if pcfg.method == "full":
        return model
    for p in model.parameters():
        p.requires_grad_(False)
    def adapt(parent: nn.Module, name: str) -> None:
        setattr(parent, name, LoRALinear(getattr(parent, name), pcfg.rank, pcfg.alpha, pcfg.dropout,
                                         pcfg.rslora, dora=pcfg.method == "dora"))

    for block in model.layers.values():
        for target in pcfg.target_modules:
            if target in TARGETS:
                adapt(getattr(block, TARGETS[target]), target)
    if "lm_head" in pcfg.target_modules and model.lm_head is not None:  # not on early pipeline stages
        adapt(model, "lm_head")
    if "embed" in pcfg.target_modules and model.embed is not None:  # the first stage's
        model.embed = LoRAEmbedding(model.embed, pcfg.rank, pcfg.alpha, pcfg.rslora)
    if pcfg.method == "qlora":
        from kiln.peft.qlora import quantize_base

        quantize_base(model, shards)
    return model


@torch.no_grad()
def finalize_tuning(model: nn.Module, cfg: JobConfig) -> nn.Module:
    """After the weights are materialised and initialised or loaded: give the adapters their
    own initialisation (init_weights drew them as base weights). QLoRA's NF4 base was
    quantised as it was loaded (kiln.parallel.dtensor.copy_full_into)."""
    if cfg.peft.method == "full":
        return model
    for name, layer in adapter_layers(model):
        layer.init_adapter(cfg.train.seed, name)
    return model


@torch.no_grad()
def merge_tuning(model: nn.Module) -> nn.Module:
    """Replace every adapter layer by a plain nn.Linear (nn.Embedding) holding its merged weight
    (fp32). A tied output layer keeps the base weight: merging unties it."""
    for name, layer in adapter_layers(model):
        parent_name, _, child = name.rpartition(".")
        if isinstance(layer, LoRAEmbedding):
            merged = nn.Embedding(layer.num_embeddings, layer.embedding_dim)
            merged.weight.copy_(layer.merged_weight())
            setattr(model.get_submodule(parent_name), child, merged)
            continue
        merged = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None)
        merged.weight.copy_(layer.merged_weight())
        if layer.bias is not None:
            merged.bias.copy_(full_tensor(layer.bias).float())
        setattr(model.get_submodule(parent_name), child, merged)
    return model


def trainable_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def check_layout(cfg: JobConfig, layout: Layout) -> None:
    """Combinations not supported yet, as a clear error before anything is built."""
    if cfg.peft.method != "full" and cfg.precision.dtype == "fp8":
        raise KilnError(f"peft.method {cfg.peft.method} with precision.dtype fp8: adapters over "
                        "float8 linear layers are not wired in; use precision.dtype bf16 (or auto)")
    if cfg.peft.method == "qlora" and cfg.parallel.tp > 1:
        raise KilnError(f"peft.method qlora with parallel.tp={cfg.parallel.tp}: splitting an NF4 "
                        "base for tensor parallel is not wired in; shard it with dp_shard (FSDP2), "
                        "or use peft.method lora")
    if cfg.peft.method == "qlora" and (layout.pp > 1 or layout.dp_replicate > 1):
        raise KilnError(f"peft.method qlora with {layout}: QLoRA runs in one process or sharded "
                        "over dp_shard (FSDP2) ranks; pipeline stages and replicas (pp, "
                        "dp_replicate) of an NF4 base are not wired in. Use dp_shard for all "
                        "ranks, or peft.method lora")
