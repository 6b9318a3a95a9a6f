"""The typed job config: YAML loading, `--set` overrides, validation and clear errors.

Each section is a pydantic model; unknown keys are refused, values are coerced to the
field's type, and impossible combinations are caught here, before anything runs.
"""

from __future__ import annotations

import sys
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kiln.errors import KilnError
from kiln.models.presets import PRESETS


def _refuse_userinfo(url: str | None, key: str, variables: str) -> None:
    """A URL field must not carry user:secret@: the config is saved with every run."""
    if url and "://" in url and "@" in url.split("://", 1)[1].split("/", 1)[0]:
        raise ValueError(f"{key} must not carry credentials (user:secret@): they would be saved "
                         f"with the config; set {variables} in the environment instead")


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RopeScaling(Section):
    type: Literal["llama3"] = "llama3"
    """Only the Llama 3 frequency scaling is supported."""
    factor: float = Field(8.0, gt=0)
    """How much the low frequencies are divided by (the context extension)."""
    low_freq_factor: float = Field(1.0, gt=0)
    """Wavelengths above original_max_seq_len / low_freq_factor are scaled fully."""
    high_freq_factor: float = Field(4.0, gt=0)
    """Wavelengths below original_max_seq_len / high_freq_factor are left as they are."""
    original_max_seq_len: int = Field(8192, gt=0)
    """The context length the model was first trained at."""


class MoEConfig(Section):
    """Mixture of experts: each token goes through top_k of n_experts SwiGLU MLPs."""

    n_experts: int = Field(gt=1)
    """Routed experts per MoE layer (Hugging Face: num_local_experts / num_experts)."""
    top_k: int = Field(2, gt=0)
    """Experts each token is sent to (num_experts_per_tok)."""
    intermediate_size: int | None = Field(None, gt=0)
    """Hidden size of each expert's SwiGLU (moe_intermediate_size); None: model.intermediate_size."""
    n_shared_experts: int = Field(0, ge=0)
    """Experts every token goes through besides its routed ones (DeepSeek), held as one SwiGLU
    of n_shared_experts x intermediate_size."""
    first_k_dense: int = Field(0, ge=0)
    """The first this many layers keep a dense MLP (of model.intermediate_size), as DeepSeek."""
    gating: Literal["softmax", "sigmoid"] = "softmax"
    """softmax: probabilities over all experts, then top-k (Mixtral, Qwen3-MoE); sigmoid: an
    independent score per expert, top-k of them (DeepSeek-V3)."""
    norm_topk_prob: bool = True
    """Rescale the top-k gate weights of each token to sum to 1 (Mixtral always does; Qwen3-MoE
    by its config; DeepSeek-V3 with sigmoid gating)."""
    aux_loss_coef: float = Field(0.01, ge=0)
    """Weight of the load-balancing loss (Switch Transformer; computed as transformers'
    load_balancing_loss_func over all MoE layers); 0 turns it off."""
    router_z_loss_coef: float = Field(0.0, ge=0)
    """Weight of the router z-loss (ST-MoE: mean squared logsumexp of the router logits)."""
    bias_update_rate: float = Field(0.0, ge=0)
    """DeepSeek-V3's auxiliary-loss-free balancing: after each optimizer step every expert's
    routing bias moves by this much toward balance (up when under-loaded, down when over-);
    the bias only picks experts, it does not weight them. 0: off (DeepSeek-V3 uses 0.001)."""

    @model_validator(mode="after")
    def _check_top_k(self) -> MoEConfig:
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k={self.top_k} exceeds n_experts={self.n_experts}")
        return self


class ModelConfig(Section):
    preset: str | None = None
    """A named shape from kiln/models/presets.py; fields set here override it."""
    init_from: str | None = None
    """A Hugging Face model directory (config.json + safetensors): its config.json gives the
    shape (fields set here override it, like a preset) and its weights initialise the model.
    Read by kiln.checkpoint.hf_import.resolve_init_from when a job starts, not here."""
    vocab_size: int = Field(8192, gt=0)
    """Rows of the embedding and the output projection; at least the tokenizer's size."""
    dim: int = Field(256, gt=0)
    """Hidden size."""
    n_layers: int = Field(4, gt=0)
    """Transformer blocks."""
    n_heads: int = Field(8, gt=0)
    """Query heads."""
    n_kv_heads: int | None = Field(None, gt=0)
    """Key/value heads for grouped-query attention; None means n_heads (plain multi-head)."""
    head_dim: int | None = Field(None, gt=0)
    """None means dim // n_heads (Qwen3 sets it explicitly)."""
    intermediate_size: int = Field(704, gt=0)
    """Hidden size of the SwiGLU MLP."""
    max_seq_len: int = Field(2048, gt=0)
    """The longest sequence the model is meant for (exported as max_position_embeddings)."""
    rope_theta: float = Field(10000.0, gt=0)
    """Base of the rotary embedding's frequencies."""
    rope_scaling: RopeScaling | None = None
    """Llama 3 long-context frequency scaling; None: plain RoPE."""
    norm_eps: float = Field(1e-5, gt=0)
    """Epsilon of every RMSNorm."""
    qkv_bias: bool = False
    """Bias on the q/k/v projections (Qwen2)."""
    qk_norm: bool = False
    """RMSNorm on each query and key head before RoPE (Qwen3)."""
    tie_embeddings: bool = False
    """The output projection shares the embedding's weight."""
    init_std: float = Field(0.02, gt=0)
    """Standard deviation of the initial weights (block output projections are scaled down
    by sqrt(2 * n_layers))."""
    moe: MoEConfig | None = None
    """Mixture of experts in place of the MLP (from layer moe.first_k_dense on); None: dense."""

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("preset") is not None:
            name = data["preset"]
            if name not in PRESETS:
                raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}")
            preset = PRESETS[name]
            # Nested sections (moe, rope_scaling) merge a level down: setting model.moe.top_k
            # keeps the preset's other moe fields.
            data = {**preset, **{k: {**preset[k], **v} if isinstance(v, dict) and isinstance(
                preset.get(k), dict) else v for k, v in data.items()}}
        return data

    @model_validator(mode="after")
    def _one_origin(self) -> ModelConfig:
        if self.preset is not None and self.init_from is not None:
            raise ValueError("set model.preset or model.init_from, not both")
        return self

    @model_validator(mode="after")
    def _check_shape(self) -> ModelConfig:
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(f"n_heads={self.n_heads} must divide dim={self.dim} "
                             "(or set head_dim explicitly)")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.head_size % 2:
            raise ValueError(f"the head size ({self.head_size}) must be even for RoPE")
        if self.moe is not None and self.moe.first_k_dense >= self.n_layers:
            raise ValueError(f"moe.first_k_dense={self.moe.first_k_dense} leaves no MoE layer "
                             f"among n_layers={self.n_layers}")
        return self

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_size(self) -> int:
        return self.head_dim or self.dim // self.n_heads


class DataSourceConfig(Section):
    name: str
    """How this source is named in reports and curriculum weights (e.g. web, code, math)."""
    path: str
    """A directory written by `kiln prepare`."""
    split: str = "train"
    """Which split of the prepared directory to read."""
    weight: float = Field(1.0, gt=0)
    """Share of training samples drawn from this source (normalised over all sources)."""
    order: Literal["shuffle", "difficulty"] = "shuffle"
    """shuffle: a fresh permutation each epoch; difficulty: documents by their prepared score,
    lowest first (needs `kiln prepare --score-field`)."""


class ValSetConfig(Section):
    name: str
    """Reported as val/<name>_loss and val/<name>_ppl."""
    path: str
    """A directory written by `kiln prepare`."""
    split: str = "val"
    """Which split of the prepared directory to read."""


class CurriculumStage(Section):
    until: float = Field(gt=0, le=1)
    """The stage lasts until this fraction of the run's steps (the last stage: 1.0)."""
    weights: dict[str, float] | None = None
    """Mixture weights by source name in this stage; None keeps the sources' own weights."""
    seq_len: int | None = Field(None, gt=0)
    """A shorter sequence length for this stage (must divide data.seq_len); tokens per step stay."""


class DataConfig(Section):
    source: Literal["stdlib", "shards"] = "stdlib"
    """'stdlib': the Python standard library's own source files, found at run time, prepared
    into shards in the run directory (with task 'sft': its functions' docstring pairs);
    'shards': directories written by `kiln prepare` (`kiln prepare --sft` for task 'sft')."""
    seq_len: int = Field(256, gt=0)
    """Tokens per training sequence."""
    val_fraction: float = Field(0.05, gt=0, lt=1)
    """stdlib: share of files held out for validation (the split is by file)."""
    max_bytes: int | None = Field(None, gt=0)
    """stdlib: read at most this many bytes of the corpus (for quick tests)."""
    tokenizer: str | None = None
    """shards: a tokenizer.json or a model directory; None: the tokenizer saved by kiln prepare
    in the first source's directory. Every source must have been prepared with it."""
    sources: list[DataSourceConfig] = []
    """shards: the training sources, mixed by weight."""
    val: list[ValSetConfig] = []
    """shards: held-out sets, each evaluated and reported separately."""
    curriculum: list[CurriculumStage] = []
    """Stages over training progress (mixture weights, sequence length); needs train.max_steps
    or train.max_tokens to know where the run ends."""
    prefetch: int = Field(2, ge=0)
    """Batches read ahead in a background thread; 0 reads in the training loop."""

    @model_validator(mode="after")
    def _check_sources(self) -> DataConfig:
        names = [s.name for s in self.sources]
        if self.source == "shards" and not self.sources:
            raise ValueError("data.source 'shards' needs at least one entry in data.sources")
        if self.source == "stdlib" and (self.sources or self.val):
            raise ValueError("data.sources and data.val are for data.source 'shards'")
        for group, listed in (("data.sources", names), ("data.val", [v.name for v in self.val])):
            if len(set(listed)) != len(listed):
                raise ValueError(f"names in {group} must be unique (got {', '.join(listed)})")
        ends = [stage.until for stage in self.curriculum]
        if ends and (ends != sorted(set(ends)) or ends[-1] != 1.0):
            raise ValueError(f"data.curriculum 'until' values must increase and end at 1.0 "
                             f"(got {ends})")
        for i, stage in enumerate(self.curriculum):
            unknown = set(stage.weights or {}) - set(names if self.sources else ["stdlib"])
            if unknown:
                raise ValueError(f"data.curriculum.{i}.weights names unknown sources "
                                 f"{sorted(unknown)}; sources are {names or ['stdlib']}")
            if stage.weights is not None and (any(w < 0 for w in stage.weights.values())
                                              or not any(w > 0 for w in stage.weights.values())):
                raise ValueError(f"data.curriculum.{i}.weights must be >= 0, some > 0")
            if stage.seq_len is not None and self.seq_len % stage.seq_len:
                raise ValueError(f"data.curriculum.{i}.seq_len={stage.seq_len} must divide "
                                 f"data.seq_len={self.seq_len}")
        return self


class OptimConfig(Section):
    lr: float = Field(3e-4, gt=0)
    """The peak learning rate (the schedule multiplies it)."""
    weight_decay: float = Field(0.1, ge=0)
    """Applied to matrices only; norms, biases and embeddings are excluded."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW's decay rates of the first and second moment estimates."""
    eps: float = Field(1e-8, gt=0)
    """AdamW's epsilon, added to the denominator."""
    grad_clip: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm to this; None turns clipping off."""


class ScheduleConfig(Section):
    kind: Literal["cosine", "wsd", "constant"] = "cosine"
    """cosine: warmup then cosine decay; wsd: warmup-stable-decay; constant: warmup then flat."""
    warmup_steps: int = Field(100, ge=0)
    """Steps of linear warmup from about zero to optim.lr."""
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    """The final LR as a fraction of optim.lr."""
    decay_fraction: float = Field(0.2, gt=0, le=1)
    """wsd only: the share of steps spent in the final (linear) decay."""


class TrainConfig(Section):
    seed: int = 0
    """Seeds the initial weights, the data order and every RNG."""
    micro_batch_size: int = Field(8, gt=0)
    """Sequences per forward/backward pass on each data-parallel rank."""
    grad_accum_steps: int = Field(1, gt=0)
    """Micro-batches per optimizer step on each rank, when no global batch size is given."""
    global_batch_size: int | None = Field(None, gt=0)
    """Sequences per optimizer step over all data-parallel ranks; the accumulation steps are
    derived from it (global = micro_batch_size x accumulation x data-parallel ranks), so a
    change of layout changes nothing in what is trained."""
    global_batch_tokens: int | None = Field(None, gt=0)
    """The same, stated in tokens (a multiple of data.seq_len)."""
    max_steps: int | None = Field(1000, gt=0)
    """Optimizer steps to run."""
    max_tokens: int | None = Field(None, gt=0)
    """Training tokens to read (over all ranks)."""
    max_time: float | None = Field(None, gt=0)
    """Seconds of training; whichever of the three budgets comes first stops the run."""
    device: str = "auto"
    """'auto' picks cuda when present, else cpu."""
    num_threads: int | None = Field(None, gt=0)
    """CPU threads for torch; None means all cores."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in backward instead of storing them."""
    compile: bool = False
    """torch.compile each transformer block."""
    log_interval: int = Field(10, gt=0)
    """Steps between metrics lines (loss, tokens/s, ...); the only host-device syncs."""
    eval_interval: int = Field(100, gt=0)
    """Steps between validation passes."""
    eval_batches: int = Field(8, gt=0)
    """Micro-batches of each validation set per pass (the same ones every time)."""
    sample_prompt: str = "def "
    """Text a sample at the end of the run continues."""
    sample_tokens: int = Field(64, ge=0)
    """Tokens of that sample; 0 skips it."""

    @model_validator(mode="after")
    def _check_budget(self) -> TrainConfig:
        if self.max_steps is None and self.max_tokens is None and self.max_time is None:
            raise ValueError("set at least one of max_steps, max_tokens, max_time")
        if self.global_batch_size is not None and self.global_batch_tokens is not None:
            raise ValueError("set train.global_batch_size or train.global_batch_tokens, not both")
        return self


class ParallelConfig(Section):
    """How the job's processes are laid out: the product of the sizes is the world size."""

    dp_replicate: int = Field(1, gt=0)
    """Data-parallel replicas, each holding a whole copy of the (sharded) model: HSDP's
    replicate dimension (with dp_shard > 1) or plain data parallel (with dp_shard = 1)."""
    dp_shard: int = Field(-1, ge=-1)
    """Ranks the parameters, gradients and optimizer state are sharded over (FSDP2);
    -1: whatever the world size leaves after the other dimensions."""
    tp: int = Field(1, gt=0)
    """Tensor-parallel ranks: attention heads and MLP columns split, sequence parallel on the norms."""
    pp: int = Field(1, gt=0)
    """Pipeline stages, each holding a contiguous run of the blocks."""
    cp: int = Field(1, gt=0)
    """Context-parallel ranks: the sequence split for ring attention (GPUs only)."""
    ep: int = Field(1, gt=0)
    """Expert-parallel ranks, taken from the dp_shard ranks (not a dimension of their own):
    each MoE layer's routed experts are split in blocks over ep consecutive dp_shard ranks,
    and tokens travel to their experts' rank and back by all-to-all. Must divide dp_shard and
    model.moe.n_experts; expert weights are FSDP-sharded over the dp ranks that remain."""
    pp_schedule: Literal["1F1B", "Interleaved1F1B", "GPipe", "InterleavedZeroBubble"] = "1F1B"
    """The pipeline schedule, from torch.distributed.pipelining."""
    pp_microbatches: int | None = Field(None, gt=0)
    """Microbatches per pipeline step; None: the gradient-accumulation steps (each micro-batch
    is one pipeline microbatch). Set, it must divide the sequences a data-parallel rank takes
    per step (micro_batch_size x accumulation steps)."""
    pp_stages_per_rank: int = Field(1, gt=0)
    """Stages each pipeline rank holds: 2 or more for the interleaved schedules."""
    reshard_after_forward: bool = True
    """FSDP2 frees each block's gathered weights after its forward (gathers again in backward):
    less memory, one more all-gather per block."""
    cpu_offload: bool = False
    """FSDP2 keeps sharded parameters, gradients and optimizer state in CPU memory."""

    @model_validator(mode="after")
    def _check_schedule(self) -> ParallelConfig:
        interleaved = self.pp_schedule in ("Interleaved1F1B", "InterleavedZeroBubble")
        if interleaved and self.pp_stages_per_rank < 2:
            raise ValueError(f"parallel.pp_schedule {self.pp_schedule} needs "
                             "parallel.pp_stages_per_rank >= 2")
        if not interleaved and self.pp_stages_per_rank != 1:
            raise ValueError(f"parallel.pp_schedule {self.pp_schedule} runs one stage per rank; "
                             "set parallel.pp_stages_per_rank to 1 or use Interleaved1F1B")
        return self


class PrecisionConfig(Section):
    dtype: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "auto"
    """Compute dtype; master weights and optimizer state stay fp32. auto: bf16 where the
    hardware runs it natively (GPUs of compute capability 8.0+, ROCm MI200/MI300, CPUs with
    AVX512-BF16 or AMX, Arm CPUs with bf16), fp16 with a gradient scaler on GPUs without bf16
    (V100, T4), else fp32. fp8: float8 linear layers (torchao) under bf16 autocast, on GPUs with
    FP8 (compute capability 8.9+, MI300X); never chosen by auto."""
    fp8_recipe: Literal["rowwise", "tensorwise"] = "rowwise"
    """fp8 only: one scale per row (more accurate) or per tensor (faster, float8 all-gather)."""
    fp8_min_dim: int = Field(1024, ge=16)
    """fp8 only: a linear layer stays bf16 when its input or output size is below this
    (the casts cost more than the fp8 matmul saves on small layers)."""
    fp8_emulate: bool = False
    """fp8 only: run torchao's float8 in emulation on any device (slow; for testing numerics)."""


class MetricsConfig(Section):
    peak_tflops: float | None = Field(None, gt=0)
    """Peak for MFU, in TFLOP/s. None: a known value for H100/H200/MI300X, or measured on CPU."""
    progress_bar: Literal["auto", "on", "off"] = "auto"
    """auto: a bar on a terminal, plain lines otherwise."""


class CheckpointConfig(Section):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_by_name=True,
                              validate_by_alias=True, serialize_by_alias=True)
    dir: str | None = None
    """A local path, an NFS mount or s3://bucket/prefix; None: checkpoints/ in the run directory.
    Object-store credentials come from the environment (AWS_ACCESS_KEY_ID, ...), never from here."""
    endpoint_url: str | None = None
    """An S3-compatible endpoint; None: AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL, else AWS."""
    interval: int | None = Field(500, gt=0)
    """Save every this many steps (and always at the end); None: only at the end."""
    keep_last: int | None = Field(2, gt=0)
    """Keep the newest this many committed checkpoints; None keeps all."""
    keep_every: int | None = Field(None, gt=0)
    """Also keep every checkpoint whose step is a multiple of this (milestones)."""
    async_save: bool = Field(False, alias="async")
    """Write in the background: the loop waits only while the state is copied off the device."""
    verify: bool = True
    """Check every file against the commit marker's checksums before resuming from it."""
    enabled: bool = True

    @model_validator(mode="after")
    def _no_credentials(self) -> CheckpointConfig:
        _refuse_userinfo(self.dir, "checkpoint.dir", "AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY")
        return self


class GuardsConfig(Section):
    """What keeps a long run alive (kiln/train/guards.py): bad steps, preemption, hangs."""
    skip_bad_steps: bool = False
    """Skip the optimizer step on a non-finite loss or gradient norm, or a loss spike (and roll
    back after rollback_after in a row). It reads the loss and gradient norm every step: one
    host-device sync per step, which a GPU pipeline pays for, so it is opt-in."""
    spike_k: float = Field(6.0, gt=0)
    """A loss more than this many standard deviations above the recent window is a spike."""
    spike_window: int = Field(100, ge=2)
    """Recent good steps the spike test compares against."""
    spike_min_history: int = Field(20, ge=2)
    """No spike verdicts before this many good steps are known."""
    rollback_after: int | None = Field(3, gt=0)
    """Bad steps in a row that roll back to the last checkpoint (skipping those batches on the
    replay); None only skips."""
    max_bad_steps: int = Field(20, ge=0)
    """More bad steps than this in the whole run stop it, naming steps and data positions."""
    preemption_signals: list[Literal["SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT"]] = [
        "SIGTERM", "SIGUSR1"]
    """Signals that mean "checkpoint at the next step boundary and exit for a restart"."""
    hang_factor: float = Field(10.0, gt=1)
    """A step taking this many times the recent median step time is a hang: stacks are dumped."""
    hang_min_seconds: float = Field(60.0, gt=0)
    """... but never a step shorter than this."""
    hang_exit_after: float | None = Field(1800.0, gt=0)
    """Seconds without a finished step after which the process exits for the launcher to
    restart it; None never exits."""

    @model_validator(mode="after")
    def _check_window(self) -> GuardsConfig:
        if self.spike_min_history > self.spike_window:
            raise ValueError(f"guards.spike_min_history={self.spike_min_history} exceeds "
                             f"guards.spike_window={self.spike_window}")
        return self


class MlflowConfig(Section):
    uri: str | None = None
    """An MLflow tracking server (http://host:5000) or store URI; None: a SQLite file,
    <out_dir>/mlflow.db. A server's token comes from MLFLOW_TRACKING_TOKEN (or
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD) in the environment, never from here."""
    experiment: str = "kiln"
    """The experiment the run is filed under (created when missing)."""

    @model_validator(mode="after")
    def _no_credentials(self) -> MlflowConfig:
        _refuse_userinfo(self.uri, "tracking.mlflow.uri",
                         "MLFLOW_TRACKING_TOKEN (or MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD)")
        return self


class TrackingConfig(Section):
    """Where metrics go besides metrics.jsonl and the console (which are always written)."""

    tensorboard: bool = False
    """Write TensorBoard event files into the run directory (`tensorboard --logdir <out_dir>`)."""
    mlflow: MlflowConfig | None = None
    """None: no MLflow. A section, even an empty one (`mlflow: {}`), logs the run to MLflow."""
    eval_tasks: list[str] = []
    """JSONL task files (multiple choice, generation, held-out text; see kiln/eval/tasks.py)
    scored at every train.eval_interval; results go to every tracker."""
    best_metric: str = "val_loss"
    """The eval metric that picks the best checkpoint, which retention always keeps."""
    best_mode: Literal["min", "max"] = "min"
    """min: lower is better (losses); max: higher is better (accuracies)."""


class PeftConfig(Section):
    """The tuning method: which weights train. Applied by kiln.peft to the plain model before
    it is parallelised; the base stays frozen and out of checkpoints for every method but full."""

    method: Literal["full", "lora", "dora", "qlora"] = "full"
    """full: every weight trains; lora: low-rank adapters on target_modules, the base frozen;
    dora: LoRA plus a trained magnitude per output row (weight-decomposed LoRA); qlora: LoRA
    over a base held in 4-bit NF4 (torchao), which saves the base's memory."""
    rank: int = Field(16, gt=0)
    """The adapters' rank r: A is (r x in), B is (out x r)."""
    alpha: float = Field(32.0, gt=0)
    """The adapters' output is scaled by alpha / rank (alpha / sqrt(rank) with rslora)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the adapters' input during training (the base path sees none)."""
    rslora: bool = False
    """Rank-stabilised LoRA: scale by alpha / sqrt(rank), so higher ranks keep learning."""
    loraplus_lr_ratio: float = Field(1.0, ge=1)
    """LoRA+: the B matrices learn at optim.lr times this (A at optim.lr); the LoRA+ paper
    (Hayou et al., 2024) finds 16 or so speeds up learning. 1: plain LoRA."""
    target_modules: list[Literal["q", "k", "v", "o", "gate", "up", "down", "lm_head", "embed"]] = [
        "q", "k", "v", "o", "gate", "up", "down"]
    """Which layers get an adapter: attention q/k/v/o and MLP gate/up/down of every block, the
    output projection lm_head and the token embedding. Tied, the two keep sharing their frozen
    weight and each adapter changes its own side: the logits, or the lookup."""

    @model_validator(mode="after")
    def _check_targets(self) -> PeftConfig:
        if not self.target_modules or len(set(self.target_modules)) != len(self.target_modules):
            raise ValueError("peft.target_modules must name each layer at most once, at least one")
        if self.method == "dora" and "embed" in self.target_modules:
            raise ValueError("peft.method dora adapts linear layers; take 'embed' out of "
                             "peft.target_modules, or use method lora")
        if self.method == "full" and self.loraplus_lr_ratio != 1:
            raise ValueError("peft.loraplus_lr_ratio is for adapters (method lora, dora or "
                             "qlora); full fine-tuning has no B matrices")
        return self
class SFTConfig(Section):
    """Supervised fine-tuning (`task: sft`): examples prepared by `kiln prepare --sft` (data.source
    'shards'), or with data.source 'stdlib' the embedded task: write the docstring of a standard
    library function from its source (pairs by `ast`, held-out modules never trained on)."""

    loss_on: Literal["assistant", "last", "all"] = "assistant"
    """Which tokens are targets: every assistant turn (or response), only the last assistant
    turn of each example, or all tokens (prompts and template included)."""
    packing: bool = True
    """Pack several examples into each data.seq_len row (positions restart, no attention between
    examples); false: one example per row, padded to the longest in the micro-batch."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """Examples longer than data.seq_len + 1 tokens: cut to that length, or left out (both counted)."""
    chat_template: str | None = None
    """A Jinja chat template used instead of the tokenizer's (or kiln's default) when the run
    prepares its own examples (data.source 'stdlib'); `kiln prepare --sft --chat-template FILE`
    is the same for prepared data."""
    samples: int = Field(3, ge=0)
    """Held-out examples whose last response is generated (greedy, up to train.sample_tokens)
    and printed next to the reference at the end of the run."""
    base_job: str | None = None
    """A job config (path) that makes model.init_from when it is missing or older than that job's
    weights: trained first if it has no final weights, then exported there in Hugging Face form."""
    base_overrides: list[str] = []
    """`--set` style overrides for base_job (e.g. a shorter pretraining)."""


class JobConfig(Section):
    name: str = "run"
    """The run directory is <out_dir>/<name>."""
    task: Literal["pretrain", "sft"] = "pretrain"
    """What is trained (kiln/tasks/): next-token prediction on documents, or supervised
    fine-tuning on prompt/response examples with the loss on the responses."""
    out_dir: str = "runs"
    """The folder that holds run directories."""
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    optim: OptimConfig = OptimConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    train: TrainConfig = TrainConfig()
    precision: PrecisionConfig = PrecisionConfig()
    parallel: ParallelConfig = ParallelConfig()
    metrics: MetricsConfig = MetricsConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    guards: GuardsConfig = GuardsConfig()
    tracking: TrackingConfig = TrackingConfig()
    peft: PeftConfig = PeftConfig()
    sft: SFTConfig = SFTConfig()

    @model_validator(mode="after")
    def _check_job(self) -> JobConfig:
        if self.data.seq_len > self.model.max_seq_len and self.model.init_from is None:
            raise ValueError(f"data.seq_len={self.data.seq_len} exceeds "
                             f"model.max_seq_len={self.model.max_seq_len}")
        mlp_targets = [t for t in self.peft.target_modules if t in ("gate", "up", "down")]
        if self.peft.method != "full" and self.model.moe is not None and mlp_targets:
            raise ValueError(
                f"peft.target_modules {mlp_targets}: this model's MLPs are mixtures of experts "
                f"(moe, from layer {self.model.moe.first_k_dense} on), whose experts are grouped "
                "weights that adapters do not cover yet; adapt attention (peft.target_modules: "
                "[q, k, v, o], lm_head and embed too if wanted) or use peft.method full")
        tokens = self.train.global_batch_tokens
        if tokens is not None and tokens % self.data.seq_len:
            raise ValueError(f"train.global_batch_tokens={tokens} is not a multiple of "
                             f"data.seq_len={self.data.seq_len}")
        return self

    @property
    def run_dir(self) -> Path:
        return Path(self.out_dir) / self.name

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


@dataclass(frozen=True)
class BatchPlan:
    """Sequences per micro-batch and per optimizer step, for a given data-parallel degree."""

    micro_batch_size: int
    grad_accum_steps: int
    global_batch_size: int
    """Sequences per optimizer step over all data-parallel ranks."""
    tokens_per_step: int
    total_steps: int | None
    """From train.max_steps or train.max_tokens; None when only train.max_time bounds the run."""


def plan_batch(cfg: JobConfig, dp: int = 1) -> BatchPlan:
    """The step's shape on `dp` data-parallel ranks; KilnError when the sizes do not divide."""
    t = cfg.train
    micro = t.micro_batch_size
    wanted = t.global_batch_size or (t.global_batch_tokens // cfg.data.seq_len
                                     if t.global_batch_tokens else None)
    if wanted is None:
        accum = t.grad_accum_steps
    elif wanted % (micro * dp):
        raise KilnError(f"train.global_batch_size={wanted} sequences cannot be split into "
                        f"micro-batches of train.micro_batch_size={micro} on {dp} data-parallel "
                        f"rank(s): it must be a multiple of {micro * dp}")
    else:
        accum = wanted // (micro * dp)
    global_batch = micro * accum * dp
    tokens = global_batch * cfg.data.seq_len
    total = t.max_steps or (t.max_tokens // tokens if t.max_tokens else None)
    return BatchPlan(micro, accum, global_batch, tokens, total)


def load_config(path: str | Path, overrides: list[str] = ()) -> JobConfig:
    """Read a YAML job file, apply `a.b=value` overrides, validate; KilnError on any problem."""
    path = Path(path)
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as e:
        raise KilnError(f"cannot read config file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise KilnError(f"config file {path} is not UTF-8 text (byte {e.object[e.start]:#04x} at "
                        f"offset {e.start}); a job config is a YAML text file") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        line = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
        raise KilnError(f"{path}{line} is not valid YAML: {getattr(e, 'problem', e)}") from None
    if raw is None:  # an empty file, or only comments: say so, it is rarely what was meant
        print(f"kiln: note: config file {path} holds no settings; every section takes its "
              "defaults", file=sys.stderr)
        raw = {}
    if not isinstance(raw, dict):
        raise KilnError(f"{path} must hold a mapping of sections (model:, data:, train:, ...), "
                        f"not a {type(raw).__name__}")
    for item in overrides:
        _apply_override(raw, item, path)
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as e:
        raise KilnError(_describe(e, path, overrides)) from None


def _apply_override(raw: dict, item: str, path: Path) -> None:
    key, sep, text = item.partition("=")
    if not sep or not key:
        raise KilnError(f"--set {item!r}: expected KEY=VALUE, e.g. --set optim.lr=1e-3")
    parts = key.strip().split(".")
    node, cls = raw, JobConfig
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise KilnError(f"--set {key}: {part!r} in {path} is not a section")
        node, cls = child, _section_class(cls, part)
    leaf = parts[-1]
    annotation = _field_annotation(cls, leaf)
    # Keep strings as typed for str and string-choice fields (a run named "007" stays "007",
    # progress_bar=off stays "off"); otherwise parse the value as YAML and let pydantic coerce
    # it to the field's type ("1e-3" -> 0.001).
    is_string = annotation is str or (typing.get_origin(annotation) is Literal and all(
        isinstance(a, str) for a in typing.get_args(annotation)))
    if is_string or not text:
        node[leaf] = text if is_string else None
        return
    try:
        node[leaf] = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise KilnError(f"--set {key}: the value {text!r} cannot be parsed "
                        f"({getattr(e, 'problem', None) or 'not valid YAML'}); quote a string, "
                        "e.g. --set 'name=\"my run\"'") from None


def _section_class(cls: type | None, name: str) -> type | None:
    annotation = _field_annotation(cls, name)
    for arg in (annotation, *typing.get_args(annotation)):
        if isinstance(arg, type) and issubclass(arg, BaseModel):
            return arg
    return None


def _field_annotation(cls: type | None, name: str) -> Any:
    if cls is None or name not in cls.model_fields:
        return None
    annotation = cls.model_fields[name].annotation
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) and len(args) == 1:
        return args[0]
    return annotation


def _describe(error: ValidationError, path: Path, overrides: list[str]) -> str:
    set_keys = {o.partition("=")[0].strip() for o in overrides}
    lines = []
    for err in error.errors():
        loc = ".".join(str(p) for p in err["loc"])
        origin = " (from --set)" if loc in set_keys else ""
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            parent = _section_at(err["loc"][:-1])
            allowed = ", ".join(parent.model_fields) if parent else "?"
            lines.append(f"unknown key '{loc}'{origin}; allowed here: {allowed}")
        elif err["type"] in ("missing",):
            lines.append(f"'{loc}' is required")
        else:
            where = f"'{loc}'" if loc else "the config"
            shown = "" if err["type"].startswith("value_error") else f" (got {err['input']!r})"
            lines.append(f"{where}{origin}: {msg}{shown}")
    return f"invalid config {path}: " + "; ".join(lines) + "."


def _section_at(loc: tuple) -> type | None:
    cls: type | None = JobConfig
    for part in loc:
        cls = _section_class(cls, str(part))
    return cls
