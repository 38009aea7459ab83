"""The training job's configuration: `eagle-ray train --config FILE [key=value ...]`.

Every key is documented by its field's docstring here (docs/configuration.md is generated from
them); unknown keys and wrong types are errors (`eagle_ray.config.loader`).

Defaults follow the public EAGLE-3 recipes for 8B-class targets (SpecForge: lr 1e-4, 7 TTT
steps, grad norm 0.5, 2048 tokens, 32k draft vocabulary); examples/tiny.yaml sets the tiny
target's own values.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from eagle_ray.config.loader import ConfigError, nested_from_dicts
from eagle_ray.config.pool import PoolConfig

DEFAULT_STEPS = 200  # train.steps when neither it nor train.epochs is given


@dataclasses.dataclass
class DataConfig:
    """The chat data the draft learns from (read and tokenised with Ray Data)."""

    path: str | list[str] | None = None
    """A JSONL or Parquet file, a folder of them, or a list; each row `{"messages": [{"role",
    "content"}]}` or ShareGPT `{"conversations": [{"from", "value"}]}`; None: the built-in
    generated chats."""
    num_samples: int = 320
    """Generated conversations (when `path` is None)."""
    max_length: int = 2048
    """Tokens per row (capped at what the target accepts); sizes the job's vLLM engines (with the
    regeneration and evaluation lengths); a shared pool with shorter rows is refused."""
    overlong: Literal["truncate", "drop"] = "truncate"
    """Rows over `max_length` (counted): train on their first `max_length` tokens, or drop them."""
    max_tokens_per_micro_batch: int = 16384
    """Padded tokens (rows x longest row) per micro-batch; a longer row goes alone."""
    micro_batch_size: int = 8
    """Rows per micro-batch at most."""
    shuffle_window: int = 256
    """Rows shuffled, sorted by length and packed into micro-batches together on each worker."""
    cpus_per_task: float = 0.1
    """CPUs of each Ray Data read / tokenise / filter task or actor."""
    tokenize_workers: int = 1
    """Ray Data actors tokenising in parallel (scale with the data and the cluster)."""
    tokenize_in_driver_mb: float = 16.0
    """Inputs of known size up to this many MiB (local files, generated data) are tokenised in
    the driver by the same stage (starting Ray Data's actors costs more than the work); 0:
    always Ray Data's actors."""
    draft_vocab_size: int = 32000
    """Draft vocabulary; at most the target's (equal: a full-vocabulary draft)."""
    eval_samples: int = 16
    """The first N conversations are held out for evaluation."""
    supervision_cache: str | None = None
    """A folder: `eagle-ray cache` writes the pool's supervision there; `eagle-ray train` then
    reads it instead of starting a pool (docs/training.md). None: no cache."""


@dataclasses.dataclass
class TrainConfig:
    """Draft training with Ray Train's `TorchTrainer` (DDP workers)."""

    workers: int = 2
    """Ray Train workers."""
    use_gpu: bool = False
    """One GPU per worker."""
    cpus_per_worker: float = 1.0
    """CPUs per worker."""
    worker_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    """Custom resources per worker, e.g. `{trainer_node: 1}` to keep trainers off target GPUs."""
    steps: int | None = None
    """Optimizer steps (per worker, DDP); None: 200, or what `epochs` gives."""
    epochs: float | None = None
    """Passes over the training rows, instead of `steps` (not both): the job packs the rows'
    lengths as the workers pack them and trains that many micro-batches per worker."""
    lr: float = 1e-4
    """AdamW learning rate, after a linear warm-up, then cosine to 10 % (the schedule of every
    optimizer group)."""
    warmup_steps: int = 20
    """Linear warm-up steps."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    optimizer: Literal["adamw", "muon"] = "adamw"
    """`adamw`: AdamW over every trained weight. `muon`: torch's Muon (Newton-Schulz
    orthogonalised momentum) over the draft's 2-D weight matrices, AdamW (`lr`,
    `weight_decay`) over the rest -- norms, `lm_head`, P-EAGLE's `mask_hidden` -- as
    speculators 0.9 splits them (docs/training.md, "Losses and optimizers")."""
    muon_lr: float | None = None
    """Muon's learning rate (`optimizer: muon`); None: `lr`."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov), in [0, 1)."""
    muon_weight_decay: float = 0.1
    """Muon's decoupled weight decay."""
    muon_ns_steps: int = 5
    """Muon's Newton-Schulz iterations."""
    muon_adjust_lr: Literal["original", "match_rms_adamw"] = "match_rms_adamw"
    """How Muon scales its learning rate by a matrix's shape: `match_rms_adamw` (Moonshot's
    0.2 sqrt(max(A, B)): updates of AdamW's size, so AdamW's `lr` carries over) or `original`
    (Keller Jordan's sqrt(max(1, A / B)))."""
    loss: Literal["forward_kl", "reverse_kl", "jensen_shannon", "total_variation",
                  "lk_hybrid", "neg_log_acceptance"] = "forward_kl"
    """What each TTT step or block slot is scored with against the target's draft-vocabulary
    distribution p (q: the draft's): `forward_kl` (soft cross-entropy -sum p log q, every
    kind's objective before this key existed), `reverse_kl` KL(q || p), `jensen_shannon`,
    `total_variation` 1 - alpha with alpha = sum min(p, q) (the acceptance rate),
    `lk_hybrid` (KL blended into TV as alpha grows, `lk_eta`), `neg_log_acceptance` -log alpha
    (`eagle_ray/contract/losses.py`, docs/training.md "Losses and optimizers")."""
    lk_eta: float = 3.0
    """`loss: lk_hybrid`'s blend temperature eta: weight exp(-eta alpha) on KL, the rest on TV
    (the LK paper's 3)."""
    grad_clip: float = 0.5
    """Gradient norm clip."""
    max_nonfinite_steps: int = 5
    """Steps in a row whose loss or gradient is NaN or inf before the job stops with an error;
    each such step is skipped on every worker (no weight written, counted as `nonfinite_steps`
    in the metrics)."""
    ttt_steps: int = 7
    """Draft tokens trained per position: EAGLE-3's test-time-training steps, P-EAGLE's
    parallel depths, DFlash's block size - 1 (every `eval.num_speculative_tokens` must be at
    most this)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """`auto`: bf16 autocast on a GPU with bf16 (fp32 master weights and optimizer state, TF32
    matmuls), fp32 on the CPU; bf16 on a GPU without it is an error."""
    gpu_memory_gib: float | None = None
    """GPU memory per GPU (GiB) for the memory check before training (`eagle-ray plan`'s)
    where no GPU is present (a driver without one); a GPU present is measured and wins, and
    every worker checks the GPU it got. None: an assumed 80 GiB where no GPU is present."""
    prefetch: int = 4
    """Micro-batches each worker keeps in flight at the pool."""
    checkpoint_every: int = 50
    """Steps between checkpoints."""
    log_every: int = 10
    """Steps between logged metrics."""
    seed: int = 0
    """Data order and initialisation."""
    intermediate_size: int | None = None
    """Draft MLP width; None: the target's."""
    max_failures: int = 0
    """Worker failures Ray Train recovers from (latest checkpoint); -1: no limit."""
    max_controller_failures: int = 3
    """Worker-group start failures (e.g. never scheduled) before the job fails."""
    loggers: list[str] = dataclasses.field(default_factory=list)
    """Experiment trackers fed by rank 0 (`eagle_ray.train.trackers`): `tensorboard`, `mlflow`."""
    mlflow_tracking_uri: str | None = None
    """MLflow server or store; None: the folder `<output_dir>/mlruns`."""
    mlflow_experiment: str = "eagle_ray"
    """MLflow experiment."""


@dataclasses.dataclass
class DraftSpec:
    """Which draft the job trains (docs/training.md, "Draft kinds"); the same pool, data, Ray
    Train loop, precision and export path for each."""

    kind: Literal["eagle3", "peagle", "dflash"] = "eagle3"
    """`eagle3`: chain drafting, one draft forward per drafted token (trained with TTT over
    `train.ttt_steps` steps); `peagle`: P-EAGLE, all k tokens in one forward (the k - 1 slots
    after the first read a mask token and a learned `mask_hidden`; served with vLLM's
    `parallel_drafting`; trained over `train.ttt_steps` depths); `dflash`: DFlash, a block of
    `train.ttt_steps + 1` slots (the bonus token, then masks) drafted in one non-causal forward
    conditioned only on the target's aux layers (`target.aux_layer_ids`, any number; served as
    vLLM's `dflash` method)."""
    num_layers: int = 1
    """Decoder layers. EAGLE-3 / P-EAGLE: the first reads [embedding ; features] as EAGLE-3's
    one does, the rest are plain Llama layers (vLLM loads any number); the P-EAGLE references
    train 4: its mask slots carry no content of their own into the first layer. DFlash: Qwen3
    layers reading the context features in their attention."""
    mask_token_id: int | None = None
    """The mask token of P-EAGLE and DFlash (a target token id no text uses); None: the first
    id past the tokenizer where the vocabulary has room (Qwen's padded vocabularies), else the
    pad token."""
    anchors_per_row: int = 512
    """DFlash: blocks trained per row, anchored at answer tokens drawn uniformly (SpecForge's
    `num_anchors`)."""
    loss_weighting: Literal["decay", "dpace"] = "decay"
    """DFlash: how block slots' losses are weighted: `decay` exp(-(j - 1) / gamma), the DFlash
    paper's, or `dpace` D-PACE's weights from the draft's confidence in the target's top token
    at each slot of the block (arXiv 2605.18810; speculators' and ModelOpt's DFlash default)."""
    loss_decay_gamma: float | None = None
    """DFlash with `loss_weighting: decay`: block slot j's loss weight is exp(-(j - 1) / gamma);
    None: the paper's choice for the block size (7 for 16, 5 for 10, 4 for 8 and below)."""
    dpace_alpha: float = 0.5
    """DFlash with `loss_weighting: dpace`: confidence smoothing (1 - alpha) q + alpha, in
    (0, 1] (the paper's 0.5)."""


@dataclasses.dataclass
class RegenerateConfig:
    """Answers regenerated by the target through the pool (`eagle-ray regenerate`, or before
    training when `enabled`): a draft learns to predict what its target says."""

    enabled: bool = False
    """The training job regenerates its data's answers first (one JSONL file or generated data;
    cached in `output_dir`)."""
    temperature: float = 0.0
    """Sampling temperature; 0: greedy."""
    top_p: float = 1.0
    """Nucleus sampling."""
    max_new_tokens: int | None = 256
    """Longest answer generated (an answer ends at the chat's end-of-turn token); None: as long
    as a training row (`data.max_length`), so no answer is cut that a row would keep."""
    seed: int = 0
    """Sampling seed."""
    conversations_per_wave: int = 256
    """Conversations answered together, turn by turn."""
    prompts_per_request: int = 16
    """Prompts in one request to a replica."""


@dataclasses.dataclass
class EvalConfig:
    """Acceptance length of the exported draft, as published drafts are compared (vLLM serving
    it, chain drafting k tokens, greedy and sampled; `eagle_ray.evaluation.evaluate`)."""

    enabled: bool = True
    """Evaluate the exported draft at the end of the job."""
    prompts: int = 8
    """Prompts evaluated: the first of `prompts_file`, or held-out conversations."""
    prompts_file: str | None = None
    """JSONL of MT-Bench (`turns`, answered turn by turn), GSM8K (`question`) or chat
    (`messages` / `conversations`) lines; None: the job's held-out conversations."""
    max_new_tokens: int = 32
    """New tokens per turn."""
    num_speculative_tokens: list[int] = dataclasses.field(default_factory=lambda: [3, 7])
    """Draft tokens per step (k), each at most `train.ttt_steps` (SpecBundle reports k = 3 and
    7): one table cell each."""
    temperatures: list[float] = dataclasses.field(default_factory=lambda: [0.0, 1.0])
    """Sampling temperatures: one table cell each."""
    samples_per_prompt: int = 1
    """Answers vLLM samples per prompt at a temperature above 0 (pooled; the interval resamples
    prompts): more verify steps for the comparison with the exact expectation on vLLM's own
    answers to tell a 10 % shortfall from chance."""
    bootstrap_samples: int = 1000
    """Resamples of the prompts for the 95 % interval."""
    seed: int = 0
    """Seed of sampling at temperature > 0 (the simulation's, and vLLM's engine: its requests
    carry none, docs/training.md "vLLM at temperature 1") and of the bootstrap."""
    vllm: bool = True
    """Measure with vLLM serving the draft (false: the greedy simulation only)."""


@dataclasses.dataclass
class JobConfig:
    """`eagle-ray train --config FILE [key=value ...]`: the top-level keys."""

    target: PoolConfig = dataclasses.field(default_factory=PoolConfig)
    """The pool the job starts (or joins): `PoolConfig`'s keys."""
    use_shared_pool: bool = False
    """Join the pool named `target.name` started by `eagle-ray serve`."""
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    """The chat data: `DataConfig`'s keys."""
    draft: DraftSpec = dataclasses.field(default_factory=DraftSpec)
    """Which draft: `DraftSpec`'s keys."""
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    """Draft training: `TrainConfig`'s keys."""
    regenerate: RegenerateConfig = dataclasses.field(default_factory=RegenerateConfig)
    """The target's own answers: `RegenerateConfig`'s keys."""
    eval: EvalConfig = dataclasses.field(default_factory=EvalConfig)
    """Acceptance of the exported draft: `EvalConfig`'s keys."""
    output_dir: str = "runs/tiny"
    """Metrics, vocabulary, draft, summary, report."""
    run_name: str = "eagle3-draft"
    """Ray Train run (same name: resume; refused if the settings that shape the draft changed)."""
    storage_path: str | None = None
    """Ray Train storage (shared storage on clusters); None: `<output_dir>/ray_results`."""
    ray_address: str | None = None
    """None: `RAY_ADDRESS`, else a running local cluster, else a new one."""

    def __post_init__(self) -> None:
        nested_from_dicts(self)
        train = self.train
        if train.steps is not None and train.epochs is not None:
            raise ConfigError(f"train.steps ({train.steps}) and train.epochs ({train.epochs}) "
                              f"both set: give one (epochs: the job derives the steps)")
        _check_train(train)
        draft = self.draft
        _check_draft(draft)
        if self.target.takes_images and draft.kind != "eagle3":
            raise ConfigError(
                f"draft.kind={draft.kind!r} with a vision-language target: vLLM drafts "
                f"text-only for parallel drafts beside one (it feeds them no image positions), "
                f"so a draft trained on image supervision would be served on other inputs; "
                f"train draft.kind: eagle3 for this target")
        if self.target.takes_images and self.regenerate.enabled:
            raise ConfigError("regenerate.enabled with a vision-language target: the pool "
                              "regenerates answers from text prompts only; set "
                              "regenerate.enabled: false (train on the data's own answers)")
        if self.target.takes_images and self.eval.enabled and any(
                t != 0 for t in self.eval.temperatures):
            raise ConfigError(
                "a vision-language target's draft is measured greedily, on the pool's backend "
                "and (eval.vllm) by vLLM serving it (eagle_ray.evaluation.images): set "
                "eval.temperatures: [0.0]")
        if train.steps is None and train.epochs is None:
            train.steps = DEFAULT_STEPS
        if self.regenerate.max_new_tokens is None:
            self.regenerate.max_new_tokens = self.data.max_length


def _check_train(train: TrainConfig) -> None:
    """Values the types allow and training cannot take, refused as the config loads."""
    if train.epochs is not None and train.epochs <= 0:
        raise ConfigError(f"train.epochs must be > 0, got {train.epochs}")
    if train.max_nonfinite_steps < 1:
        raise ConfigError(f"train.max_nonfinite_steps must be >= 1, got "
                          f"{train.max_nonfinite_steps}")
    if not (math.isfinite(train.lk_eta) and train.lk_eta >= 0):
        raise ConfigError(f"train.lk_eta must be a finite number >= 0 (the LK paper's 3.0), "
                          f"got {train.lk_eta}")
    if train.muon_lr is not None and not train.muon_lr > 0:
        raise ConfigError(f"train.muon_lr must be > 0, or null for train.lr, got "
                          f"{train.muon_lr}")
    if not 0 <= train.muon_momentum < 1:
        raise ConfigError(f"train.muon_momentum must be in [0, 1) (speculators' 0.95), got "
                          f"{train.muon_momentum}")
    if train.muon_weight_decay < 0:
        raise ConfigError(f"train.muon_weight_decay must be >= 0, got "
                          f"{train.muon_weight_decay}")
    if not 1 <= train.muon_ns_steps < 100:
        raise ConfigError(f"train.muon_ns_steps must be in [1, 100) (torch's Muon; 5 is "
                          f"Keller Jordan's), got {train.muon_ns_steps}")


def _check_draft(draft: DraftSpec) -> None:
    if draft.num_layers < 1:
        raise ConfigError(f"draft.num_layers must be >= 1, got {draft.num_layers}")
    if draft.anchors_per_row < 1:
        raise ConfigError(f"draft.anchors_per_row must be >= 1, got {draft.anchors_per_row}")
    if draft.loss_decay_gamma is not None and draft.loss_decay_gamma <= 0:
        raise ConfigError(f"draft.loss_decay_gamma must be > 0 (or null), got "
                          f"{draft.loss_decay_gamma}")
    if not 0 < draft.dpace_alpha <= 1:
        raise ConfigError(f"draft.dpace_alpha must be in (0, 1] (the paper's 0.5), got "
                          f"{draft.dpace_alpha}")
    if draft.loss_weighting == "dpace" and draft.kind != "dflash":
        raise ConfigError(f"draft.loss_weighting: dpace weights DFlash's block slots; a "
                          f"draft of kind {draft.kind} weights its TTT steps 0.8^k: set "
                          f"draft.loss_weighting: decay or draft.kind: dflash")
    if draft.loss_weighting == "dpace" and draft.loss_decay_gamma is not None:
        raise ConfigError("draft.loss_decay_gamma is the decay's; with draft.loss_weighting: "
                          "dpace leave it null")
