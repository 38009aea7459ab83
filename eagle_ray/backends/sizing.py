"""A job's engines sized from what the job sends them, not from the checkpoint.

A Llama-3.1 checkpoint says `max_position_embeddings: 131072`; an engine started with that
`max_model_len` must fit one 131,072-token request in its KV cache before it serves anything,
which the CPU default budget (512 MiB) refuses even for a tiny Llama-3.1-shaped target, and on
a GPU it reserves for a length a 4,096-token job never sends. A job knows its longest
sequence: training rows of `data.max_length`, and regeneration and evaluation prompts (rows of
the same data) plus their new tokens. Engines get that (vLLM: plus the one token it samples,
unless the job sets `target.vllm_kwargs.max_model_len` itself; `engines.Engine.sized_for`).

What a vLLM engine's KV cache holds per token is computed here as vLLM 0.32's own KV-cache specs
count it (`kv_cache_bytes_per_token`, tested against vLLM's spec classes), and what vLLM reserves
before it sizes the cache, which only a GPU can profile, is a stated assumption
(`engine_reserves`); `eagle-ray plan` adds them up.
"""

from __future__ import annotations

from typing import Any

from eagle_ray.backends.engines import ENGINES
from eagle_ray.config import ConfigError, JobConfig, PoolConfig

ACTIVATION_BYTES_PER_BATCHED_TOKEN = 160 * 2**10
"""An assumption (no GPU has measured it for eagle_ray): vLLM's profile run forwards
`max_num_batched_tokens` tokens and samples, and takes its peak from the KV cache's budget
(`Worker.determine_available_memory`). 160 KiB per batched token on every rank: vLLM's
profiling log of Llama-3-8B on an H100 (vllm-project/vllm#10511) reports a 1.26 GiB peak at
8,192 batched tokens, at TP 1 and TP 2 alike, so the figure is not divided by TP."""
CUDA_GRAPH_POOL_BYTES = 2**30
"""An assumption (no GPU has measured it for eagle_ray): vLLM 0.32 captures CUDA graphs unless
`enforce_eager`, and takes its estimate of their pool from the KV cache's budget
(`GPUModelRunner.profile_cudagraph_memory`: the largest graph's capture plus at least 1 MiB for
each further capture size; `VLLM_MEMORY_PROFILER_ESTIMATE_CUDAGRAPHS` is on by default). 1 GiB
per rank."""
# vLLM 0.32's `max_num_batched_tokens` for `vllm.LLM` when not set (EngineArgs.get_batch_defaults):
# 16,384 on GPUs of 70 GiB and more but the A100 (not told apart here: the larger reserve), else
# 8,192.
LARGE_GPU_GIB, LARGE_GPU_BATCHED_TOKENS, BATCHED_TOKENS = 70, 16384, 8192


def longest_sequence(job: JobConfig) -> int:
    """Tokens of the longest sequence the job sends a target engine (prompt + new tokens)."""
    longest = job.data.max_length
    if job.regenerate.enabled:
        longest = max(longest, job.data.max_length + job.regenerate.max_new_tokens)
    if job.eval.enabled:
        longest = max(longest, job.data.max_length + job.eval.max_new_tokens)
    return longest


def sized_pool_config(job: JobConfig) -> PoolConfig:
    """`job.target` with its engines sized for `longest_sequence` (a factory backend as it is)."""
    engine = ENGINES.get(job.target.backend)
    return job.target if engine is None else engine.sized_for(job.target, longest_sequence(job))


def check_rows_fit(job: JobConfig, pool_max_length: int | None) -> None:
    """A shared pool whose engines accept shorter rows than the job's is refused before
    training, with both numbers (a job's own pool is sized for it)."""
    if pool_max_length is not None and job.data.max_length > pool_max_length:
        raise ConfigError(
            f"data.max_length is {job.data.max_length} tokens but the shared pool "
            f"{job.target.name!r} accepts rows of at most {pool_max_length} (its engines' "
            f"max_model_len {pool_max_length + 1}): lower data.max_length to {pool_max_length}, "
            f"or restart the pool with target.vllm_kwargs.max_model_len >= "
            f"{longest_sequence(job) + 1}")


def kv_cache_bytes_per_token(text: Any, tp_size: int, dtype_bytes: int,
                             captured_states: int) -> dict[str, int]:
    """Bytes one token takes in a vLLM replica's KV cache on each TP rank, as vLLM 0.32's specs
    count them (`page_size_bytes / block_size`; all of them share one block table): every
    attention layer's K and V for the rank's KV heads (at least one: ranks past the model's KV
    heads hold copies), or latent attention's one latent per layer on every rank; and the
    `extract_hidden_states` capture layer (`HiddenStateCacheSpec`), the token's
    `captured_states` hidden states whole on every rank. At the target's dtype (`kv_cache_dtype`
    "auto"). Exact where every attention layer has one spec (every shipped recipe); with mixed
    layers (sliding windows, hybrids) vLLM groups them and pads the capture layer's pages to the
    widest group's, which this does not model: it then overstates the tokens the cache holds.
    `text`: the target's transformers text config."""
    if getattr(text, "kv_lora_rank", None):
        attention = text.num_hidden_layers * (text.kv_lora_rank + text.qk_rope_head_dim)
    else:
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
        kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
        attention = 2 * text.num_hidden_layers * max(1, kv_heads // tp_size) * head_dim
    parts = {"attention": attention * dtype_bytes,
             "captured_states": captured_states * text.hidden_size * dtype_bytes}
    return {**parts, "total": sum(parts.values())}


def batched_tokens(vllm_kwargs: dict[str, Any], gpu_memory_gib: float) -> int:
    """The engine's `max_num_batched_tokens`: the job's, else vLLM's default for the GPU."""
    if vllm_kwargs.get("max_num_batched_tokens"):
        return int(vllm_kwargs["max_num_batched_tokens"])
    return LARGE_GPU_BATCHED_TOKENS if gpu_memory_gib >= LARGE_GPU_GIB else BATCHED_TOKENS


def engine_reserves(vllm_kwargs: dict[str, Any], gpu_memory_gib: float) -> dict[str, int]:
    """Bytes per rank vLLM takes from `gpu_memory_utilization`'s budget for its own work before
    it sizes the KV cache: the profile run's activations and the CUDA-graph pool (the module's
    assumed figures)."""
    graphs = 0 if vllm_kwargs.get("enforce_eager") else CUDA_GRAPH_POOL_BYTES
    return {"activations": batched_tokens(vllm_kwargs, gpu_memory_gib)
            * ACTIVATION_BYTES_PER_BATCHED_TOKEN, "cuda_graphs": graphs}


def gpu_engine_kwargs(pool: PoolConfig) -> dict[str, Any]:
    """The vLLM keyword arguments a replica's engine starts with on a GPU."""
    from eagle_ray.backends.vllm.runner import GPU_DEFAULTS

    return {**GPU_DEFAULTS, **pool.vllm_kwargs}


def reserve_assumptions(pool: PoolConfig, gpu_memory_gib: float) -> dict[str, Any]:
    """The assumed figures behind a replica's `engine_reserves`, for `eagle-ray plan`'s output."""
    return {"max_num_batched_tokens": batched_tokens(gpu_engine_kwargs(pool), gpu_memory_gib),
            "activation_kib_per_batched_token": ACTIVATION_BYTES_PER_BATCHED_TOKEN // 2**10,
            "cuda_graph_pool_gib": CUDA_GRAPH_POOL_BYTES / 2**30,
            "replica_reserves_from": "assumed (vLLM profiles them on the GPU; no GPU "
                                     "measurement yet)"}


# ----------------------------------------------------------------- vision-language targets

VISION_WORKSPACE_MARGIN = 1.25
"""An assumption (no GPU has measured it for eagle_ray): the vision encoder's peak per patch is
one MLP's live tensors (the residual stream and its norm at the tower's width, the gate/up
outputs and their activation: 2 x hidden + 3 x intermediate values in the target's dtype) plus
the patch's pixels in fp32 and in the target's dtype, times this margin for attention,
rotary tables and kernels' workspaces (Qwen2.5-VL: 40 KiB per patch). Not divided by TP: the
residual stream is whole on every rank."""
DEFAULT_MAX_IMAGE_TOKENS = 16384
"""Tokens of the largest image where neither `target.vllm_kwargs.mm_processor_kwargs.max_pixels`
nor the target's preprocessor_config.json says otherwise: the Qwen2-VL / Qwen3-VL image
processors' default (`max_pixels` 16,384 x (patch x merge)^2: 12,845,056 at 14-pixel patches)."""
MAX_VIDEO_FRAMES = 14  # vLLM 0.32's Qwen2-VL dummy video at most (qwen2_vl._MAX_FRAMES_PER_VIDEO)


def max_pixels(pool: PoolConfig, preprocessor: dict[str, Any], vision: Any) -> int:
    """Pixels of the largest image a replica's engine accepts: vLLM's
    `mm_processor_kwargs.max_pixels` (or `size.longest_edge`), else the target's
    preprocessor_config.json's, else the processors' default."""
    for source in (pool.vllm_kwargs.get("mm_processor_kwargs") or {}, preprocessor):
        value = source.get("max_pixels") or (source.get("size") or {}).get("longest_edge")
        if value:
            return int(value)
    return DEFAULT_MAX_IMAGE_TOKENS * (vision.patch_size * vision.spatial_merge_size) ** 2


def mm_limit(pool: PoolConfig, modality: str) -> int | None:
    """`target.vllm_kwargs.limit_mm_per_prompt[modality]` (a count or `{count: n}`); None: unset
    (vLLM's default: 999)."""
    limit = (pool.vllm_kwargs.get("limit_mm_per_prompt") or {}).get(modality)
    return int(limit["count"] if isinstance(limit, dict) else limit) if limit is not None else None


def image_budget(target_config: Any, pool: PoolConfig, preprocessor: dict[str, Any],
                 gpu_memory_gib: float, max_model_len: int, row_tokens: int) -> dict[str, Any]:
    """What a vision-language replica's engine encodes, as vLLM 0.32 budgets it
    (`multimodal.encoder_budget.MultiModalBudget`): the largest image is `max_pixels` // (patch
    x merge)^2 tokens (`get_image_size_with_most_features`); a video (unless
    `limit_mm_per_prompt.video` is 0) holds as many such frames as `max_model_len` takes, two per
    temporal patch, 14 frames at most; the profile run encodes the larger item as many times as
    `max(max_num_batched_tokens, item)` holds, at least once, and keeps the outputs (the encoder
    cache) while it runs the language model. A row holds `limit_mm_per_prompt.image` images at
    most (unset: assumed 1), each at most the largest: its image tokens are bounded by that and
    by `row_tokens`."""
    vision = target_config.vision_config
    unit = vision.patch_size * vision.spatial_merge_size
    pixels = max_pixels(pool, preprocessor, vision)
    image = pixels // unit**2
    video = 0 if mm_limit(pool, "video") == 0 else image * max(1, min(
        max_model_len // max(image, 1), MAX_VIDEO_FRAMES // 2))
    item = max(image, video)
    budget = max(batched_tokens(gpu_engine_kwargs(pool), gpu_memory_gib), item)
    images_per_row = mm_limit(pool, "image")
    return {"max_pixels": pixels, "pixels_per_token": unit**2, "image_tokens": image,
            "profiled_item": "video"
            if video >= image else "image", "profiled_items": max(1, budget // max(item, 1)),
            "profiled_item_tokens": item, "images_per_row": images_per_row or 1,
            "images_per_row_from": "limit_mm_per_prompt" if images_per_row else "assumed",
            "image_tokens_per_row": min((images_per_row or 1) * image, row_tokens)}


def vision_reserves(target_config: Any, budget: dict[str, Any], dtype_bytes: int,
                    text_activations: int) -> dict[str, int]:
    """Bytes per rank the profile run's images add to vLLM's reserves beyond the language
    model's activations: its peak is the larger of the encoder's pass (`VISION_WORKSPACE_MARGIN`
    per patch, assumed) and the encoder cache held during the language model's pass."""
    vision = target_config.vision_config
    tokens = budget["profiled_items"] * budget["profiled_item_tokens"]
    patches = tokens * vision.spatial_merge_size**2
    patch_values = getattr(vision, "in_channels", 3) * vision.temporal_patch_size \
        * vision.patch_size**2
    per_patch = (dtype_bytes * (2 * vision.hidden_size + 3 * vision.intermediate_size)
                 + (4 + dtype_bytes) * patch_values) * VISION_WORKSPACE_MARGIN
    cache = tokens * vision.out_hidden_size * dtype_bytes
    return {"vision_encoder": max(int(patches * per_patch) - text_activations, cache)}


def vision_tower_sharded(pool: PoolConfig, target_config: Any) -> bool:
    """Whether a replica's ranks split the vision tower: vLLM 0.32's Qwen2.5-VL / Qwen3-VL towers
    are QKV / column / row-parallel linears (`qwen2_5_vl.Qwen2_5_VisionAttention`, `...MLP`,
    `...PatchMerger`) split like the language model's (`mm_encoder_tp_mode: weights`, the
    default), whole on every rank under `mm_encoder_tp_mode: data` or where the TP size does not
    divide the tower's heads (`vision.is_vit_use_data_parallel`). Sharded, its weights divide
    by TP (the patch embedding and norms, replicated, are under 0.3 % of them)."""
    heads = target_config.vision_config.num_heads
    return (pool.vllm_kwargs.get("mm_encoder_tp_mode", "weights") != "data"
            and heads % pool.tp_size == 0)


VISION_MODULES = ("visual.", "vision_tower.", "multi_modal_projector.")  # Qwen-VL, LLaVA-likes
PER_TOKEN_VISION_MODULES = ("merger", "multi_modal_projector.")  # run once per merged token


def parameter_counts(target_config: Any) -> dict[str, int]:
    """Parameters of the target, from one skeleton on the meta device (transformers' own model
    class): `language` (the language model and its head), `active` (those a text token passes
    through: a mixture of experts' routed experts count `num_experts_per_tok` of their number,
    shared experts and routers in full) and, for a vision-language target, `vision` (the vision
    tower and its mergers) and `vision_flops_per_image_token` (2 per tower parameter per patch,
    merge^2 patches per image token; the mergers' once per token)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vision_config = getattr(target_config, "vision_config", None)
    auto = AutoModelForImageTextToText if vision_config is not None else AutoModelForCausalLM
    with torch.device("meta"):
        model = auto.from_config(target_config)
    text = target_config.get_text_config()
    experts = next((getattr(text, name) for name in ("num_experts", "num_local_experts",
                                                     "n_routed_experts")
                    if getattr(text, name, None)), None)
    share = text.num_experts_per_tok / experts if experts else 1.0
    merge = getattr(vision_config, "spatial_merge_size", 1)
    counts = dict.fromkeys(("language", "vision", "vision_flops_per_image_token"), 0)
    active = 0.0
    for name, p in model.named_parameters():
        if any(part in name for part in VISION_MODULES):
            counts["vision"] += p.numel()
            per_token = any(part in name for part in PER_TOKEN_VISION_MODULES)
            counts["vision_flops_per_image_token"] += 2 * p.numel() * (1 if per_token
                                                                       else merge**2)
        else:
            counts["language"] += p.numel()
            active += p.numel() * (share if ".experts." in name else 1.0)
    return {**counts, "active": int(active)}


def preprocessor_config(target_config: Any) -> dict[str, Any]:
    """The target's preprocessor_config.json beside its config.json ({} where there is none)."""
    import json
    from pathlib import Path

    folder = Path(getattr(target_config, "name_or_path", "") or ".")
    path = (folder if folder.is_dir() else folder.parent) / "preprocessor_config.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def vision_plan(job: JobConfig, target_config: Any, counts: dict[str, int], row_tokens: int,
                gpu_memory_gib: float, tflops: float) -> dict[str, Any] | None:
    """A vision-language target's part of `eagle-ray plan` (None for a text-only one): the
    tower's parameters and whether TP splits them, what vLLM's profile run encodes
    (`image_budget`), the image tokens of a row of `row_tokens` and what they add to a row
    token's FLOPs (their share of the rows times the tower's FLOPs per image token), and what
    the router's caps hold at that cost (`tflops`: the rate's assumed compute per GPU)."""
    if getattr(target_config, "vision_config", None) is None:
        return None
    pool = sized_pool_config(job)
    max_model_len = pool.vllm_kwargs.get("max_model_len") or longest_sequence(job) + 1
    budget = image_budget(target_config, job.target, preprocessor_config(target_config),
                          gpu_memory_gib, max_model_len, row_tokens)
    share = budget["image_tokens_per_row"] / row_tokens
    flops_per_token = share * counts["vision_flops_per_image_token"]
    rate = tflops * 1e12 * job.target.tp_size / (2 * counts["active"] + flops_per_token)
    rows = max(1, min(job.data.micro_batch_size, job.data.max_tokens_per_micro_batch
                      // row_tokens))
    return {**budget, "parameters": counts["vision"],
            "sharded": vision_tower_sharded(job.target, target_config),
            "image_share": round(share, 4), "flops_per_token": flops_per_token,
            "image_token_cost": round(1 + counts["vision_flops_per_image_token"]
                                      / (2 * counts["active"]), 3),
            "micro_batch_image_tokens": rows * budget["image_tokens_per_row"],
            "outstanding_s": job.target.max_outstanding_tokens_per_replica / rate,
            "engine_call_image_tokens": job.target.max_tokens_per_engine_call * share}


def image_lines(vision: dict[str, Any], max_length: int) -> list[str]:
    """`eagle-ray plan`'s lines on a vision-language target's images (`vision_plan`)."""
    v = vision
    lines = [f"  assumed: vision encoder ({v['profiled_items']} {v['profiled_item']}(s) of "
             f"{v['profiled_item_tokens']:,} tokens per profile run, max_pixels "
             f"{v['max_pixels']:,}; {VISION_WORKSPACE_MARGIN}x one MLP's activations per "
             f"patch; tower {'split by TP' if v['sharded'] else 'whole on every rank'})",
             f"images: {v['images_per_row']} per row ({v['images_per_row_from']}) of at most "
             f"{v['image_tokens']:,} tokens: up to {v['image_tokens_per_row']:,} image tokens "
             f"a row ({v['image_share']:.0%} of it), each costing {v['image_token_cost']:.2f}x "
             f"a text token's FLOPs (the replica's rate counts them)",
             f"router: its caps count a row's image tokens as tokens: up to "
             f"{v['micro_batch_image_tokens']:,} in a micro-batch, "
             f"{v['engine_call_image_tokens']:,.0f} in an engine call; "
             f"max_outstanding_tokens_per_replica is ~{v['outstanding_s']:.1f} s of a replica's "
             f"work at this share"]
    if v["image_tokens"] > max_length:
        lines.append(f"WARNING: the largest image ({v['image_tokens']:,} tokens at max_pixels "
                     f"{v['max_pixels']:,}) is longer than a row (data.max_length "
                     f"{max_length:,}): set target.vllm_kwargs.mm_processor_kwargs.max_pixels "
                     f"below {max_length * v['pixels_per_token']:,}, so a row holds its image "
                     f"and its text")
    return lines
