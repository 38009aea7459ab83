"""`eagle-ray plan`: what a job needs per GPU, before it starts.

The trainer's activation peak is not a formula: one training step (target-head decoding, the TTT
forward and backward) runs at the recipe's full shape on fake tensors (`FakeTensorMode`: shapes,
no memory, no compute; about a second at 8B) and `TensorMemoryProbe` counts what it allocates.
Weights, gradients and optimizer state are counted from the modules themselves. The replica side
reads the target's config: weights, vLLM's reserves (assumed: `backends.sizing`), and the KV
cache `gpu_memory_utilization` leaves, in tokens of the target's KV plus the captured states.
Rates are estimates from FLOPs at a stated model-FLOPs utilisation, until a GPU benchmark
measures them. The GPU's memory is `--gpu-memory-gib` when `eagle-ray plan` is given it, else
the one present (`torch.cuda.mem_get_info`), else `train.gpu_memory_gib`, else an assumed 80 GiB
that the output says is assumed: a job planned for an 80 GB card must not pass on a 24 GB one.

Example:
    $ eagle-ray plan --config examples/llama3.1-8b.yaml --target-config llama-3.1-8b/config.json
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from eagle_ray.backends.engines import ENGINES
from eagle_ray.backends.sizing import (
    engine_reserves,
    gpu_engine_kwargs,
    image_lines,
    kv_cache_bytes_per_token,
    parameter_counts,
    reserve_assumptions,
    sized_pool_config,
    vision_plan,
    vision_reserves,
)
from eagle_ray.config import JobConfig, PoolConfig
from eagle_ray.contract.supervision import DraftVocab, draft_target
from eagle_ray.contract.target_batch import NUM_AUX_LAYERS, Eagle3TargetBatch
from eagle_ray.contract.target_head import TargetHead
from eagle_ray.draft.kinds import build_draft, draft_class
from eagle_ray.draft.model import DraftConfig
from eagle_ray.train.memory import TensorMemoryProbe, cuda_attention_kernels

GIB = 2**30
# Stated assumptions (no GPU measurement yet): what a CUDA context and the caching allocator's
# slack take per process, and the model-FLOPs utilisation rates are estimated at.
CUDA_CONTEXT_BYTES = 1 * GIB
DEFAULT_MFU = 0.4
DEFAULT_GPU_TFLOPS = 989.0  # H100 SXM dense bf16
# What a trainer worker may use of its GPU: the rest is the caching allocator's fragmentation,
# NCCL's buffers and kernels' workspaces, which the fake-tensor step does not see.
TRAINER_SHARE = 0.8
ASSUMED_GPU_MEMORY_GIB = 80.0  # planning where no GPU is present and none is named
# Supply over demand outside this band is a layout that wastes GPUs (`Plan.layout_warning`).
BALANCE_BAND = (0.5, 2.0)


@dataclasses.dataclass
class Plan:
    """Per-GPU bytes of a trainer worker and of a replica, and the rates that size the pool."""

    trainer: dict[str, int]  # part -> bytes; "total" included
    replica: dict[str, int]  # part -> bytes (per tensor-parallel rank); "total" included
    kv_cache_tokens: int  # tokens the replica's KV cache holds
    kv_cache_bytes_per_token: dict[str, int]  # per rank: attention, captured_states, total
    supervision_bytes_per_token: int
    replica_tokens_per_s: float  # estimated (FLOPs at `mfu`)
    trainer_tokens_per_s: float  # estimated (FLOPs at `mfu`)
    replicas: int  # the job's (its autoscaling maximum, when it scales)
    trainers: int  # train.workers
    assumptions: dict[str, Any]

    @property
    def trainers_per_replica(self) -> float:
        return self.replica_tokens_per_s / self.trainer_tokens_per_s

    @property
    def balance(self) -> float:
        """Supervision the replicas produce over what the trainers consume (tokens/s)."""
        return (self.replicas * self.replica_tokens_per_s
                / max(self.trainers * self.trainer_tokens_per_s, 1e-9))

    @property
    def trainer_wait_share(self) -> float:
        """The share of time trainers are expected to wait for supervision (supply short)."""
        return max(0.0, 1.0 - self.balance)

    @property
    def replica_idle_share(self) -> float:
        """The share of time replicas are expected to idle (supply beyond the demand)."""
        return max(0.0, 1.0 - 1.0 / self.balance) if self.balance > 0 else 0.0

    def layout_warning(self) -> str | None:
        """What to change when supply and demand are more than 2x apart; None otherwise."""
        low, high = BALANCE_BAND
        if low <= self.balance <= high:
            return None
        fitting = max(1, round(self.trainers / self.trainers_per_replica))
        return (f"the layout wastes GPUs: {self.replicas} replica(s) supply {self.balance:.2f}x "
                f"what {self.trainers} trainer(s) consume, so trainers wait "
                f"~{self.trainer_wait_share:.0%} / replicas idle ~{self.replica_idle_share:.0%} "
                f"of the time; about {fitting} replica(s) feed {self.trainers} trainers "
                f"(change target.replicas or train.workers, and the nodes' target_gpu / "
                f"trainer_gpu resources to match)")

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self),
                "trainers_per_replica": round(self.trainers_per_replica, 2),
                "balance": round(self.balance, 3),
                "trainer_wait_share": round(self.trainer_wait_share, 3),
                "replica_idle_share": round(self.replica_idle_share, 3),
                "layout_warning": self.layout_warning()}


def gpu_memory(configured_gib: float | None = None) -> tuple[float, str]:
    """(GiB of one GPU, where the figure comes from): the GPU present here, else
    `configured_gib`, else the assumed 80 GiB. A GPU present wins: a worker's check on a 24 GiB
    card must not pass on a figure configured for 80."""
    if torch.cuda.is_available():
        _, total = torch.cuda.mem_get_info()
        return total / GIB, f"measured ({torch.cuda.get_device_name()})"
    if configured_gib is not None:
        return float(configured_gib), "configured: no GPU here"
    return ASSUMED_GPU_MEMORY_GIB, ("assumed: no GPU here; pass --gpu-memory-gib or set "
                                    "train.gpu_memory_gib")


def plan_job(job: JobConfig, target_config, gpu_memory_gib: float | None = None,
             mfu: float = DEFAULT_MFU, gpu_tflops: float = DEFAULT_GPU_TFLOPS) -> Plan:
    """The plan for `job` with the target described by `target_config` (a transformers
    config) on GPUs of `gpu_memory_gib` (`eagle-ray plan --gpu-memory-gib`: planning for GPUs
    other than this machine's; None: `gpu_memory(job.train.gpu_memory_gib)`)."""
    gpu_memory_gib, memory_source = (gpu_memory(job.train.gpu_memory_gib)
                                     if gpu_memory_gib is None
                                     else (float(gpu_memory_gib), "given"))
    text = target_config.get_text_config()
    aux_layers = len(job.target.aux_layer_ids or ()) or NUM_AUX_LAYERS
    draft_config = DraftConfig.from_target(target_config, min(job.data.draft_vocab_size,
                                                              text.vocab_size),
                                           job.train.intermediate_size, job.draft.num_layers,
                                           aux_layers)
    rows = job.data.micro_batch_size
    seq = min(job.data.max_length, job.data.max_tokens_per_micro_batch // max(rows, 1))
    target_dtype = _dtype(job.target.dtype, text)
    bf16 = job.train.precision in ("auto", "bf16")  # on a GPU with bf16, as recipes assume
    trainer = trainer_memory(draft_config, rows, seq, job.train.ttt_steps, target_dtype, bf16,
                             ddp=job.train.workers > 1, kind=job.draft.kind,
                             anchors_per_row=job.draft.anchors_per_row)
    counts = parameter_counts(target_config)
    # A vision-language target: its tower, the images vLLM's profile run encodes, and the image
    # tokens of a row (`backends.sizing.vision_plan`); None for a text-only one.
    vision = vision_plan(job, target_config, counts, seq, gpu_memory_gib, mfu * gpu_tflops)
    # The vLLM backend captures the final hidden state beside the aux layers
    # (`vllm_capture_layer_ids`).
    replica, kv_per_token = replica_memory(target_config, counts["language"], target_dtype,
                                           job.target, gpu_memory_gib, aux_layers + 1, vision)
    hidden = text.hidden_size
    if job.target.encoding_dtype == "fp8":
        per_token = (aux_layers + 1) * hidden + 4 * (aux_layers + 1)
    else:
        per_token = (aux_layers + 1) * hidden * target_dtype.itemsize
    flops = mfu * gpu_tflops * 1e12
    draft_trainable = sum(p.numel() for p in _meta_draft(draft_config, job.draft.kind)
                          .parameters() if p.requires_grad)
    # Prefill: 2 FLOPs per parameter a token passes through (a mixture of experts' active ones;
    # an image token also its share of the vision tower's). Training: 6 per trainable draft
    # parameter per draft pass of a token, plus the target head's decoding (2 x H x V).
    replica_rate = flops * job.target.tp_size / (2 * counts["active"] + (
        vision["flops_per_token"] if vision else 0))
    trainer_rate = flops / (6 * draft_trainable * draft_passes_per_token(job, seq)
                            + 2 * hidden * text.vocab_size)
    scaling = job.target.autoscaling
    return Plan(trainer=trainer, replica=replica,
                kv_cache_tokens=replica["kv_cache"] // kv_per_token["total"],
                kv_cache_bytes_per_token=kv_per_token,
                supervision_bytes_per_token=per_token, replica_tokens_per_s=replica_rate,
                trainer_tokens_per_s=trainer_rate,
                replicas=scaling.max_replicas if scaling else job.target.replicas,
                trainers=job.train.workers,
                assumptions={"draft": job.draft.kind, "gpu_memory_gib": gpu_memory_gib,
                             "gpu_memory_from": memory_source, "mfu": mfu,
                             "gpu_tflops": gpu_tflops, "micro_batch": [rows, seq],
                             "trainer_precision": "bf16" if bf16 else "fp32",
                             "cuda_context_gib": CUDA_CONTEXT_BYTES / GIB,
                             **reserve_assumptions(job.target, gpu_memory_gib),
                             **({"vision": vision, "max_length": job.data.max_length}
                                if vision else {}),
                             "rates_from": "FLOPs estimates (no GPU measurement yet: "
                                           "`eagle-ray bench gpu` measures them)"})


def read_target_config(job: JobConfig, source: str | None = None):
    """The target's transformers config: from `source` (a config.json or folder, when the
    checkpoint is not readable here), else the job's `target.model_path`."""
    from transformers import AutoConfig

    from eagle_ray.backends import resolve_model_path

    source = source or resolve_model_path(job.target)
    try:
        return AutoConfig.from_pretrained(source)
    except OSError as e:
        raise FileNotFoundError(f"cannot read the target's config at {source} ({e}); pass "
                                f"--target-config with its config.json or folder (shipped: "
                                f"examples/targets/)") from e


def check_trainer_fits(plan: Plan, budget_gib: float | None = None) -> None:
    """A `ValueError` naming the keys to change when a trainer worker would not fit its
    budget (None: `TRAINER_SHARE` of the plan's GPU memory)."""
    gpu = plan.assumptions["gpu_memory_gib"]
    budget_gib = TRAINER_SHARE * gpu if budget_gib is None else budget_gib
    total = plan.trainer["total"] / GIB
    if total > budget_gib:
        rows, seq = plan.assumptions["micro_batch"]
        raise ValueError(
            f"a trainer worker needs {total:.1f} GiB per GPU at micro-batches of {rows} x {seq} "
            f"tokens, over its {budget_gib:.1f} GiB budget ({TRAINER_SHARE:.0%} of a "
            f"{gpu:.0f} GiB GPU, {plan.assumptions['gpu_memory_from']}): lower "
            f"data.micro_batch_size, data.max_tokens_per_micro_batch or data.max_length, or "
            f"train.ttt_steps")


def check_job_fits(job: JobConfig, plan: Plan, trainer_budget_gib: float | None = None
                   ) -> None:
    """The trainer's and (for an engine with a KV cache) the replica's checks, for a GPU job."""
    check_trainer_fits(plan, trainer_budget_gib)
    engine = ENGINES.get(job.target.backend)
    max_model_len = engine.max_model_len(sized_pool_config(job)) if engine else None
    if max_model_len is not None:
        check_replica_fits(plan, max_model_len)


def check_worker_memory(job: JobConfig, model_path: str) -> None:
    """A trainer worker's check on the GPU it got (measured: `train.gpu_memory_gib` does not
    override it), before it allocates anything: the driver may have planned on another GPU."""
    from transformers import AutoConfig

    check_trainer_fits(plan_job(job, AutoConfig.from_pretrained(model_path)))


def check_replica_fits(plan: Plan, max_model_len: int) -> None:
    """A `ValueError` naming the keys to change when a replica's rank would not fit its GPU
    (vLLM's share plus the target head) or its KV cache -- what the weights and vLLM's reserves
    leave, at the target's KV plus the captured states per token -- holds less than one request
    of `max_model_len` tokens."""
    gpu = plan.assumptions["gpu_memory_gib"]
    total = plan.replica["total"] / GIB
    where = f"a {gpu:.0f} GiB GPU ({plan.assumptions['gpu_memory_from']})"
    if plan.kv_cache_tokens < max_model_len:
        raise ValueError(
            f"a replica's KV cache holds {plan.kv_cache_tokens:,} tokens on {where}, less than "
            f"one request of max_model_len {max_model_len:,} (per GPU: weights "
            f"{plan.replica['weights'] / GIB:.1f} GiB, reserves for activations "
            f"{plan.replica['activations'] / GIB:.1f} GiB and CUDA graphs "
            f"{plan.replica['cuda_graphs'] / GIB:.1f} GiB, assumed; "
            f"{plan.kv_cache_bytes_per_token['total'] / 2**10:.0f} KiB per token): raise "
            f"target.tp_size or target.vllm_kwargs.gpu_memory_utilization, lower "
            f"data.max_length or target.vllm_kwargs.max_num_batched_tokens"
            f"{_vision_advice(plan)}, or set target.vllm_kwargs.enforce_eager")
    if total > gpu:
        raise ValueError(
            f"a replica needs {total:.1f} GiB per GPU (gpu_memory_utilization's share plus the "
            f"{plan.replica['target_head'] / GIB:.1f} GiB target head) on {where}: lower "
            f"target.vllm_kwargs.gpu_memory_utilization")


def _vision_advice(plan: Plan) -> str:
    """What check_replica_fits adds for a vision-language target's replica."""
    if "vision_weights" not in plan.replica:
        return ""
    return (f" (the vision tower takes {plan.replica['vision_weights'] / GIB:.1f} GiB and its "
            f"encoder {plan.replica['vision_encoder'] / GIB:.1f} GiB, assumed) or "
            f"target.vllm_kwargs.mm_processor_kwargs.max_pixels")


def trainer_memory(config: DraftConfig, rows: int, seq: int, ttt_steps: int,
                   supervision_dtype: torch.dtype, bf16: bool, ddp: bool,
                   kind: str = "eagle3", anchors_per_row: int = 512) -> dict[str, int]:
    """Bytes of one trainer worker: fp32 weights (the draft of `kind` with the target's frozen
    embedding, and the target head it decodes with), gradients, AdamW state, DDP's gradient
    buckets, and the peak of one training step at `rows x seq` tokens, measured on fake
    tensors with each attention call allocating what CUDA's kernel for it would."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    draft = _meta_draft(config, kind, anchors_per_row)
    trainable = sum(p.numel() for p in draft.parameters() if p.requires_grad) * 4
    weights = sum(p.numel() for p in draft.parameters()) * 4
    head_weights = (config.vocab_size + 1) * config.hidden_size * 4
    vocab = DraftVocab(torch.arange(config.draft_vocab_size), config.vocab_size)
    with torch.device("meta"):
        head = TargetHead(nn.RMSNorm(config.hidden_size),
                          nn.Linear(config.hidden_size, config.vocab_size, bias=False))
    with FakeTensorMode(allow_non_fake_inputs=True):
        draft = draft.to_empty(device="cpu")
        head = head.to_empty(device="cpu").requires_grad_(False)
        with TensorMemoryProbe() as probe, cuda_attention_kernels():
            batch = _fake_batch(rows, seq, config.target_hidden_size, supervision_dtype,
                                config.num_aux_layers)
            probs, position_mask = draft_target(batch, vocab, head)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                loss, _, _ = draft.objective(draft, batch.aux_hidden_states, batch.input_ids,
                                             batch.loss_mask, probs, position_mask, ttt_steps)
            loss.backward()
    batch_bytes = batch.nbytes  # the prefetcher holds the next one on the device too
    parts = {"weights": weights + head_weights, "optimizer": 2 * trainable,
             "ddp_buckets": trainable if ddp else 0, "step_peak": probe.peak,
             "next_batch": batch_bytes, "cuda_context": CUDA_CONTEXT_BYTES}
    return {**parts, "total": sum(parts.values())}


def replica_memory(target_config, parameters: int, dtype: torch.dtype, pool: PoolConfig,
                   gpu_memory_gib: float, captured_states: int,
                   vision: dict[str, Any] | None = None
                   ) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes per tensor-parallel rank of a replica holding `parameters` (a vision-language
    target's language model; `vision`: its tower and images, `sizing.vision_plan`), and its KV
    cache's bytes per token: vLLM takes `gpu_memory_utilization` of the GPU and gives the cache
    what the weights, a CUDA context and its own reserves (assumed) leave."""
    text = target_config.get_text_config()
    engine_kwargs = gpu_engine_kwargs(pool)
    budget = int(float(engine_kwargs["gpu_memory_utilization"]) * gpu_memory_gib * GIB)
    weights = parameters * dtype.itemsize // pool.tp_size
    reserves = engine_reserves(engine_kwargs, gpu_memory_gib)
    if vision:
        reserves = {"vision_weights": vision["parameters"] * dtype.itemsize
                    // (pool.tp_size if vision["sharded"] else 1), **reserves,
                    **vision_reserves(target_config, vision, dtype.itemsize,
                                      reserves["activations"])}
    kv_cache = max(budget - weights - CUDA_CONTEXT_BYTES - sum(reserves.values()), 0)
    # eagle_ray's target head (final norm + lm_head, whole on the first rank's GPU), loaded
    # after vLLM sized its cache: outside gpu_memory_utilization.
    head = (text.vocab_size + 1) * text.hidden_size * dtype.itemsize
    parts = {"weights": weights, **reserves, "kv_cache": kv_cache,
             "cuda_context": CUDA_CONTEXT_BYTES, "target_head": head}
    return ({**parts, "total": sum(parts.values())},
            kv_cache_bytes_per_token(text, pool.tp_size, dtype.itemsize, captured_states))


def draft_passes_per_token(job: JobConfig, seq: int) -> float:
    """Draft forward passes a supervised token costs (the kind's `passes_per_token`)."""
    return draft_class(job.draft.kind).passes_per_token(job.train.ttt_steps, seq,
                                                        job.draft.anchors_per_row)


def _fake_batch(rows: int, seq: int, hidden: int, dtype: torch.dtype, aux_layers: int
                ) -> Eagle3TargetBatch:
    ids = torch.zeros(rows, seq, dtype=torch.long)
    mask = torch.ones(rows, seq, dtype=torch.long)
    return Eagle3TargetBatch(
        aux_hidden_states=torch.empty(rows, seq, aux_layers * hidden, dtype=dtype),
        input_ids=ids, attention_mask=mask, loss_mask=mask,
        last_hidden=torch.empty(rows, seq, hidden, dtype=dtype), num_aux_layers=aux_layers)


def _meta_draft(config: DraftConfig, kind: str = "eagle3", anchors_per_row: int = 512
                ) -> nn.Module:
    with torch.device("meta"):
        return build_draft(kind, config, mask_token_id=0, anchors_per_row=anchors_per_row)


def _dtype(name: str, text_config) -> torch.dtype:
    from eagle_ray.contract.checkpoint import resolve_dtype

    return resolve_dtype(None if name == "auto" else name, text_config)


def format_plan(plan: Plan) -> str:
    """The plan as a short table (GiB), for the terminal."""
    def table(title: str, parts: dict[str, int]) -> list[str]:
        return [title] + [f"  {name:<14}{value / GIB:8.1f} GiB" for name, value in parts.items()]

    a, kv = plan.assumptions, {k: v / 2**10 for k, v in plan.kv_cache_bytes_per_token.items()}
    lines = [f"GPU: {a['gpu_memory_gib']:.0f} GiB ({a['gpu_memory_from']})"]
    lines += table(f"trainer worker (per GPU; {a['draft']} draft, micro-batch "
                   f"{a['micro_batch'][0]} x {a['micro_batch'][1]} tokens, "
                   f"{a['trainer_precision']})", plan.trainer)
    lines += table("replica (per GPU)", plan.replica)
    lines += [f"  KV cache holds {plan.kv_cache_tokens:,} tokens of {kv['total']:.0f} KiB "
              f"(target's KV {kv['attention']:.0f}, captured states {kv['captured_states']:.0f})",
              f"  assumed: activations ({a['max_num_batched_tokens']:,} batched tokens x "
              f"{a['activation_kib_per_batched_token']} KiB) and CUDA graphs (not measured yet)",
              *(image_lines(a["vision"], a["max_length"]) if "vision" in a else ()),
              f"supervision: {plan.supervision_bytes_per_token:,} bytes per token, "
              f"{plan.supervision_bytes_per_token * plan.replica_tokens_per_s / 2**20:,.0f} "
              f"MiB/s per replica",
              f"rates (estimated from FLOPs at {a['mfu']:.0%} of {a['gpu_tflops']:.0f} TFLOPS; "
              f"no GPU measurement yet): replica {plan.replica_tokens_per_s:,.0f} tok/s, "
              f"trainer {plan.trainer_tokens_per_s:,.0f} tok/s -> "
              f"{plan.trainers_per_replica:.1f} trainer GPUs per replica keep trainers fed",
              f"the job: {plan.replicas} replica(s) supply "
              f"{plan.replicas * plan.replica_tokens_per_s:,.0f} tok/s, {plan.trainers} "
              f"trainer(s) consume {plan.trainers * plan.trainer_tokens_per_s:,.0f} tok/s: "
              f"supply/demand {plan.balance:.2f} (trainers wait ~{plan.trainer_wait_share:.0%}, "
              f"replicas idle ~{plan.replica_idle_share:.0%})"]
    if plan.layout_warning():
        lines.append(f"WARNING: {plan.layout_warning()}")
    return "\n".join(lines)
