"""FP8 training: swap the model's large linear layers for torchao's Float8Linear, from outside
the model (the torchtitan way: before tensor parallel, compile and FSDP)."""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from kiln.config import PrecisionConfig
from kiln.errors import KilnError
from kiln.train.precision import Hardware, resolve_precision

# The output projection feeds the loss directly; fp8's 3 mantissa bits there cost accuracy
# for little speed (one matmul of many), as in torchtitan and torchao's recipes.
KEEP_HIGH_PRECISION = ("lm_head",)


def float8_filter(cfg: PrecisionConfig):
    """The module filter: which nn.Linear layers become float8 (fqn, module) -> bool."""

    def convert(module: nn.Module, fqn: str) -> bool:
        if not isinstance(module, nn.Linear) or fqn.split(".")[-1] in KEEP_HIGH_PRECISION:
            return False
        out_features, in_features = module.weight.shape
        # FP8 tensor-core matmuls need both sizes to be multiples of 16; below fp8_min_dim the
        # casts and scales cost more than the faster matmul saves.
        return (in_features % 16 == 0 and out_features % 16 == 0
                and min(in_features, out_features) >= cfg.fp8_min_dim)

    return convert


def convert_to_float8(model: nn.Module, cfg: PrecisionConfig, hardware: Hardware,
                      fsdp_float8_all_gather: bool = False) -> list[str]:
    """Convert `model`'s large linear layers to float8 training in place; returns their names.

    Call it on the plain model (the meta device is fine) before tensor parallel, compile and
    FSDP. KilnError on hardware without FP8 unless precision.fp8_emulate is set.
    fsdp_float8_all_gather (tensorwise only): FSDP2 gathers the weights in float8.
    """
    # The clear error for hardware without FP8 (unless emulated).
    resolve_precision(cfg.model_copy(update={"dtype": "fp8"}), hardware)
    Float8LinearConfig, convert_to_float8_training = _torchao()
    config = Float8LinearConfig.from_recipe_name(cfg.fp8_recipe)
    if fsdp_float8_all_gather and cfg.fp8_recipe != "tensorwise":
        raise KilnError("float8 all-gather with FSDP needs precision.fp8_recipe: tensorwise "
                        f"(it is {cfg.fp8_recipe}); set it, or leave the weights gathered in bf16")
    config = dataclasses.replace(config, emulate=cfg.fp8_emulate,
                                 enable_fsdp_float8_all_gather=fsdp_float8_all_gather)
    keep = float8_filter(cfg)
    converted = [fqn for fqn, m in model.named_modules() if keep(m, fqn)]
    if not converted:
        return []
    convert_to_float8_training(model, module_filter_fn=keep, config=config)
    return converted


def _torchao():
    try:
        torchao_logger = logging.getLogger("torchao")
        level = torchao_logger.level
        if not torch.cuda.is_available():
            # A CPU build cannot load torchao's CUDA kernels and says so on import; expected.
            torchao_logger.setLevel(logging.ERROR)
        try:
            from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        finally:
            torchao_logger.setLevel(level)
    except ImportError as e:
        raise KilnError(f"precision.dtype=fp8 needs torchao ({e}); install it with "
                        "pip install 'kiln[fp8]' (torchao==0.18.0)") from None
    return Float8LinearConfig, convert_to_float8_training
