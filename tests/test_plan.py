"""`eagle-ray plan`: the trainer's memory measured on fake tensors matches a real step, a
replica's KV cache is what vLLM's own allocator makes of it, the shipped GPU recipes fit an 80 GB
GPU with headroom, and a GPU too small for a trainer or a replica is refused (by the plan, before
training, and by each worker on the GPU it measures)."""

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from eagle_ray.backends.sizing import (
    ACTIVATION_BYTES_PER_BATCHED_TOKEN,
    CUDA_GRAPH_POOL_BYTES,
    parameter_counts,
)
from eagle_ray.cli import main
from eagle_ray.config import JobConfig, load_yaml
from eagle_ray.contract.aux_layers import resolve_aux_layer_ids, vllm_capture_layer_ids
from eagle_ray.contract.supervision import DraftVocab, draft_target
from eagle_ray.contract.target_head import TargetHead
from eagle_ray.draft.kinds import build_draft
from eagle_ray.draft.model import DraftConfig
from eagle_ray.plan import (
    DEFAULT_GPU_TFLOPS,
    DEFAULT_MFU,
    GIB,
    TRAINER_SHARE,
    check_job_fits,
    check_replica_fits,
    check_trainer_fits,
    check_worker_memory,
    format_plan,
    gpu_memory,
    plan_job,
    trainer_memory,
)
from eagle_ray.testing import random_micro_batch
from eagle_ray.train.memory import TensorMemoryProbe

RECIPES = {"llama3.1-8b": "llama-3.1-8b-instruct", "qwen3-8b": "qwen3-8b",
           "llama3.1-8b-smoke": "llama-3.1-8b-instruct",
           "llama3.1-8b-colocated": "llama-3.1-8b-instruct", "qwen3-30b-a3b": "qwen3-30b-a3b",
           "llama3.1-8b-peagle": "llama-3.1-8b-instruct",
           "llama3.1-8b-dflash": "llama-3.1-8b-instruct",
           "qwen2.5-vl-7b": "qwen2.5-vl-7b-instruct"}


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize(("kind", "layers"), [("eagle3", 1), ("peagle", 2), ("dflash", 2)])
def test_the_fake_step_peak_is_the_real_steps_peak_on_the_cpu(precision, kind, layers):
    config = DraftConfig(hidden_size=128, target_hidden_size=128, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=32, intermediate_size=256,
                         vocab_size=512, draft_vocab_size=256, num_layers=layers)
    rows, seq, steps = 2, 192, 3
    planned = trainer_memory(config, rows, seq, steps, torch.float32, precision == "bf16",
                             ddp=False, kind=kind)["step_peak"]
    # The same step for real: random values, real kernels.
    torch.manual_seed(0)
    draft = build_draft(kind, config, mask_token_id=0)
    head = TargetHead(torch.nn.RMSNorm(128), torch.nn.Linear(128, 512, bias=False))
    head.requires_grad_(False)
    vocab = DraftVocab(torch.arange(256), 512)
    ids, attention, loss_mask = random_micro_batch(512, (seq,) * rows)
    from eagle_ray.contract.target_batch import Eagle3TargetBatch

    with TensorMemoryProbe() as probe:
        batch = Eagle3TargetBatch(aux_hidden_states=torch.randn(rows, seq, 3 * 128),
                                  input_ids=ids.clone(), attention_mask=attention.clone(),
                                  loss_mask=attention.clone(),
                                  last_hidden=torch.randn(rows, seq, 128))
        probs, position_mask = draft_target(batch, vocab, head)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16"):
            loss, _, _ = draft.objective(draft, batch.aux_hidden_states, batch.input_ids,
                                         batch.loss_mask, probs, position_mask, steps)
        loss.backward()
    assert planned == pytest.approx(probe.peak, rel=0.05), (planned, probe.peak)


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_shipped_gpu_recipe_fits_an_80_gib_gpu(recipe):
    job = load_yaml(JobConfig, f"examples/{recipe}.yaml", [])
    plan = plan_job(job, AutoConfig.from_pretrained(f"examples/targets/{RECIPES[recipe]}"),
                    gpu_memory_gib=80)
    assert plan.trainer["total"] <= TRAINER_SHARE * 80 * GIB, plan.trainer
    check_job_fits(job, plan)
    assert plan.replica["total"] <= 80 * GIB
    # The job's own engines: sized for its rows and regenerated answers (backends/sizing.py).
    from eagle_ray.backends.sizing import sized_pool_config

    assert plan.kv_cache_tokens >= sized_pool_config(job).vllm_kwargs["max_model_len"] \
        > job.data.max_length
    hidden = AutoConfig.from_pretrained(f"examples/targets/{RECIPES[recipe]}"
                                        ).get_text_config().hidden_size
    layers = len(job.target.aux_layer_ids or (1, 2, 3))
    assert plan.supervision_bytes_per_token == (layers + 1) * hidden * 2  # NH + H in bf16


def test_a_mixture_of_experts_target_costs_its_active_parameters_per_token():
    """Qwen3-30B-A3B holds 30.5B parameters (all on its replicas) and runs 3.3B per token (its
    published figures), so one replica feeds more trainers than a dense 8B."""
    job = load_yaml(JobConfig, "examples/qwen3-30b-a3b.yaml", [])
    moe = plan_job(job, AutoConfig.from_pretrained("examples/targets/qwen3-30b-a3b"))
    assert moe.replica["weights"] == pytest.approx(30.5e9 * 2 / job.target.tp_size, rel=0.01)
    dense = plan_job(load_yaml(JobConfig, "examples/qwen3-8b.yaml", []),
                     AutoConfig.from_pretrained("examples/targets/qwen3-8b"))
    # Per GPU: 2 x 3.35B FLOPs per token on two GPUs vs 2 x 8.19B on one.
    ratio = (moe.replica_tokens_per_s / job.target.tp_size) / dense.replica_tokens_per_s
    assert ratio == pytest.approx(8.19 / 3.35, rel=0.02)


def test_a_recipe_that_cannot_fit_is_refused_naming_the_keys(capsys):
    args = ["plan", "--config", "examples/llama3.1-8b.yaml", "--target-config",
            "examples/targets/llama-3.1-8b-instruct"]
    assert main(args) == 0
    assert "trainer worker" in capsys.readouterr().out
    # Four times the rows: the activations alone pass the budget.
    assert main([*args, "data.micro_batch_size=8", "data.max_tokens_per_micro_batch=32768"]) == 2


def test_plan_without_a_readable_target_config_says_what_to_pass(caplog):
    assert main(["plan", "--config", "examples/llama3.1-8b.yaml"]) == 2
    assert "--target-config" in caplog.text


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_every_shipped_layout_agrees_with_the_plan(recipe):
    """Replicas x their rate against trainers x theirs: within 2x either way, so neither side's
    GPUs mostly wait (`Plan.balance`)."""
    job = load_yaml(JobConfig, f"examples/{recipe}.yaml", [])
    plan = plan_job(job, AutoConfig.from_pretrained(f"examples/targets/{RECIPES[recipe]}"))
    assert plan.layout_warning() is None, plan.layout_warning()
    assert 0.5 <= plan.balance <= 2.0


def test_a_layout_the_plan_contradicts_is_named_with_what_fits():
    """The control: one replica per node feeding seven trainers (the layout shipped before)."""
    job = load_yaml(JobConfig, "examples/llama3.1-8b-colocated.yaml",
                    ["target.replicas=4", "train.workers=28"])
    plan = plan_job(job, AutoConfig.from_pretrained("examples/targets/llama-3.1-8b-instruct"))
    warning = plan.layout_warning()
    assert plan.balance < 0.5 and warning is not None
    assert "4 replica(s) supply" in warning and "trainers wait" in warning
    assert f"about {round(28 / plan.trainers_per_replica)} replica(s) feed 28" in warning


LLAMA_8B = "examples/targets/llama-3.1-8b-instruct"


def fake_gpu(monkeypatch, total_gib: float | None) -> None:
    """torch.cuda as on a machine with one GPU of `total_gib` (None: no GPU)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: total_gib is not None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (3 * GIB, total_gib * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA A10G")


def test_a_measured_gpu_wins_over_the_configured_figure(monkeypatch):
    """A recipe configured for 80 GiB (`train.gpu_memory_gib`) is checked on the 24 GiB GPU a
    worker got, and refused; the configured figure plans only where no GPU is present."""
    job = load_yaml(JobConfig, "examples/llama3.1-8b.yaml", ["train.gpu_memory_gib=80"])
    fake_gpu(monkeypatch, 24)
    assert gpu_memory(80) == (24.0, "measured (NVIDIA A10G)")
    assert plan_job(job, AutoConfig.from_pretrained(LLAMA_8B)).assumptions["gpu_memory_gib"] == 24
    with pytest.raises(ValueError, match=r"24 GiB GPU, measured \(NVIDIA A10G\)\)"):
        check_worker_memory(job, LLAMA_8B)
    # `eagle-ray plan --gpu-memory-gib` plans for other GPUs than this machine's.
    assert plan_job(job, AutoConfig.from_pretrained(LLAMA_8B),
                    gpu_memory_gib=80).assumptions["gpu_memory_gib"] == 80
    fake_gpu(monkeypatch, None)  # the control: no GPU here, so the configured figure
    assert gpu_memory(80) == (80.0, "configured: no GPU here")
    check_worker_memory(job, LLAMA_8B)
    memory, source = gpu_memory()
    assert memory == 80 and source.startswith("assumed")


def test_a_trainer_worker_too_big_for_its_gpu_is_refused():
    job = load_yaml(JobConfig, "examples/llama3.1-8b.yaml", [])
    target = AutoConfig.from_pretrained(LLAMA_8B)
    check_trainer_fits(plan_job(job, target, gpu_memory_gib=80))  # the control
    with pytest.raises(ValueError, match=r"over its 19.2 GiB budget \(80% of a 24 GiB GPU, "
                                         r"given\): lower data.micro_batch_size"):
        check_trainer_fits(plan_job(job, target, gpu_memory_gib=24))


def test_a_replica_too_big_for_its_gpu_is_refused():
    """The target head (1 GiB at Llama-3.1-8B) counts beside vLLM's share of the GPU."""
    job = load_yaml(JobConfig, "examples/llama3.1-8b.yaml", [])
    target = AutoConfig.from_pretrained(LLAMA_8B)
    plan = plan_job(job, target, gpu_memory_gib=80)
    assert plan.replica["target_head"] == 128256 * 4096 * 2 + 4096 * 2
    check_replica_fits(plan, 4097)  # the control
    with pytest.raises(ValueError, match="KV cache holds 0 tokens.*raise target.tp_size"):
        check_replica_fits(plan_job(job, target, gpu_memory_gib=16), 4097)
    greedy = load_yaml(JobConfig, "examples/llama3.1-8b.yaml",
                       ["target.vllm_kwargs.gpu_memory_utilization=0.995"])
    with pytest.raises(ValueError, match="lower target.vllm_kwargs.gpu_memory_utilization"):
        check_replica_fits(plan_job(greedy, target, gpu_memory_gib=80), 4097)


VLLM_BLOCK = 16  # tokens per block; any size gives the same bytes per token
# Recipes and the targets and overrides a replica's KV cache is checked at: every shipped
# recipe, a 70B at TP 8, KV heads fewer than the TP ranks (each rank holds a copy), and
# DeepSeek's latent attention (one latent per layer, on every rank).
KV_CASES = [*((recipe, target, []) for recipe, target in sorted(RECIPES.items())),
            ("llama3.1-8b", "llama-3.1-70b", ["target.tp_size=8"]),
            ("qwen3-30b-a3b", "qwen3-30b-a3b", ["target.tp_size=8"]),
            ("llama3.1-8b", "tiny-deepseek-v2", ["target.tp_size=2"])]


@pytest.fixture(scope="module")
def target_dirs(tmp_path_factory) -> dict[str, str]:
    """config.json folders of the KV cases' targets: the shipped ones, Llama-3.1-70B's shape
    (its public config) and the tiny DeepSeek-V2."""
    from transformers import LlamaConfig

    from eagle_ray.tiny import tiny_target_config

    root = tmp_path_factory.mktemp("targets")
    LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
                max_position_embeddings=131072, rope_theta=500000.0,
                torch_dtype="bfloat16").save_pretrained(root / "llama-3.1-70b")
    tiny_target_config("deepseek_v2", 1024).save_pretrained(root / "tiny-deepseek-v2")
    return {**{path.name: str(path) for path in Path("examples/targets").iterdir()},
            **{name: str(root / name) for name in ("llama-3.1-70b", "tiny-deepseek-v2")}}


def vllm_kv_cache(model_dir: str, tp_size: int, captured_states: int, kv_cache_bytes: int
                  ) -> tuple[int, int]:
    """(bytes per token, tokens) of a KV cache of `kv_cache_bytes` on one rank, as vLLM 0.32
    makes it: the specs its attention layers and the `extract_hidden_states` capture layer
    return (`Attention` / `MLAAttention.get_kv_cache_spec`,
    `CacheOnlyAttentionLayer.get_kv_cache_spec`) from its own reading of the config, grouped and
    turned into blocks by its allocator (`kv_cache_utils`)."""
    from vllm.config import CacheConfig, ModelConfig, ParallelConfig, VllmConfig
    from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups, get_kv_cache_groups
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        HiddenStateCacheSpec,
        MLAAttentionSpec,
    )

    model = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16")
    parallel = ParallelConfig(tensor_parallel_size=tp_size)
    config = VllmConfig(model_config=model, parallel_config=parallel,
                        cache_config=CacheConfig(block_size=VLLM_BLOCK))
    # What the engine core resolves for pages of mixed shapes: a block-compact layout.
    config.cache_config.kv_cache_layout = "LBHNC"
    attention = MLAAttentionSpec if model.use_mla else FullAttentionSpec
    specs = {f"layers.{i}": attention(block_size=VLLM_BLOCK, dtype=model.dtype,
                                      num_kv_heads=model.get_num_kv_heads(parallel),
                                      head_size=model.get_head_size())
             for i in range(model.get_num_layers(parallel))}
    specs["cache_only"] = HiddenStateCacheSpec(block_size=VLLM_BLOCK, dtype=model.dtype,
                                               num_kv_heads=captured_states,
                                               head_size=model.get_hidden_size())
    groups = get_kv_cache_groups(config, specs)
    assert len(groups) == 1  # one block table: a token's every layer in one block
    kv_cache = get_kv_cache_config_from_groups(config, groups, kv_cache_bytes)
    return groups[0].kv_cache_spec.page_size_bytes // VLLM_BLOCK, kv_cache.num_blocks * VLLM_BLOCK


@pytest.mark.parametrize(("recipe", "target", "overrides"), KV_CASES)
def test_a_replicas_kv_cache_is_what_vllms_allocator_makes_of_it(recipe, target, overrides,
                                                                 target_dirs):
    """The plan's bytes per token and tokens equal vLLM's for the same bytes: the target's KV on
    the rank plus the layer holding the captured states (the job's aux ids and the final one),
    which TP does not divide."""
    job = load_yaml(JobConfig, f"examples/{recipe}.yaml", overrides)
    config = AutoConfig.from_pretrained(target_dirs[target])
    plan = plan_job(job, config, gpu_memory_gib=80)
    text, tp = config.get_text_config(), job.target.tp_size
    layers = text.num_hidden_layers
    captured = len(vllm_capture_layer_ids(resolve_aux_layer_ids(job.target.aux_layer_ids,
                                                                layers), layers))
    per_token, tokens = vllm_kv_cache(target_dirs[target], tp, captured,
                                      plan.replica["kv_cache"])
    assert plan.kv_cache_bytes_per_token["total"] == per_token
    assert tokens <= plan.kv_cache_tokens < tokens + VLLM_BLOCK
    # The control: the plan's figure before, the target's K and V alone divided by TP,
    # overstates the cache.
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    kv_only = 2 * layers * text.num_key_value_heads * head_dim * 2 // tp
    assert plan.replica["kv_cache"] // kv_only >= tokens + VLLM_BLOCK


def test_vllms_reserves_are_counted_before_its_kv_cache():
    """vLLM's activations at `max_num_batched_tokens` and its CUDA-graph pool (assumed figures,
    in the plan's assumptions) come out of the KV cache's share: at 20 GiB Llama-3.1-8B's
    weights and a CUDA context leave 1 GiB, which held 8k tokens of the target's KV alone, and
    the reserves leave nothing; eager and with fewer batched tokens, one request fits."""
    job = load_yaml(JobConfig, "examples/llama3.1-8b-smoke.yaml", [])  # vLLM's batch default
    target = AutoConfig.from_pretrained(LLAMA_8B)
    large, small = plan_job(job, target, gpu_memory_gib=80), plan_job(job, target,
                                                                      gpu_memory_gib=20)
    assert large.assumptions["max_num_batched_tokens"] == 16384  # vLLM's default on an H100
    assert small.assumptions["max_num_batched_tokens"] == 8192
    assert small.replica["activations"] == 8192 * ACTIVATION_BYTES_PER_BATCHED_TOKEN
    assert small.replica["cuda_graphs"] == CUDA_GRAPH_POOL_BYTES
    assert small.kv_cache_tokens == 0
    with pytest.raises(ValueError, match=r"holds 0 tokens.*reserves for activations 1.2 GiB "
                                         r"and CUDA graphs 1.0 GiB, assumed.*max_num_batched"):
        check_replica_fits(small, 4097)
    lean = load_yaml(JobConfig, "examples/llama3.1-8b-smoke.yaml",
                     ["target.vllm_kwargs.enforce_eager=true",
                      "target.vllm_kwargs.max_num_batched_tokens=1024"])
    plan = plan_job(lean, target, gpu_memory_gib=20)  # the control
    assert plan.replica["cuda_graphs"] == 0
    assert plan.replica["activations"] == 1024 * ACTIVATION_BYTES_PER_BATCHED_TOKEN
    check_replica_fits(plan, 4097)


def test_the_train_time_gate_stops_a_job_that_does_not_fit(tmp_path, monkeypatch):
    """`run_job` refuses before Ray or a pool starts; every worker checks its own GPU again
    (here none: the configured figure)."""
    from eagle_ray.tiny import tiny_target
    from eagle_ray.train.job import check_job_memory, run_job

    fake_gpu(monkeypatch, None)
    overrides = [f"target.model_path={LLAMA_8B}", f"output_dir={tmp_path}",
                 f"target.vllm_kwargs.tokenizer={tiny_target('llama')}"]
    small = load_yaml(JobConfig, "examples/llama3.1-8b-smoke.yaml",
                      [*overrides, "train.gpu_memory_gib=24"])
    with pytest.raises(ValueError, match="a trainer worker needs"):
        run_job(small)
    with pytest.raises(ValueError, match="24 GiB GPU"):
        check_worker_memory(small, LLAMA_8B)
    large = load_yaml(JobConfig, "examples/llama3.1-8b-smoke.yaml",
                      [*overrides, "train.gpu_memory_gib=80"])
    check_job_memory(large)  # the control
    check_worker_memory(large, LLAMA_8B)


def test_the_recipe_table_in_training_md_is_the_plans():
    """docs/training.md's table of the shipped recipes' sizes is `eagle-ray plan`'s output at
    80 GiB, not figures typed once: a change to the plan or a recipe fails here until the table
    follows."""
    doc = Path("docs/training.md").read_text()
    rows = re.findall(r"^  \| `([\w.-]+)\.yaml`[^|]*\|(.*)\|\s*$", doc, flags=re.M)
    assert [name for name, _ in rows] == ["llama3.1-8b", "qwen3-8b"], rows
    for recipe, cells in rows:
        job = load_yaml(JobConfig, f"examples/{recipe}.yaml", [])
        plan = plan_job(job, AutoConfig.from_pretrained(f"examples/targets/{RECIPES[recipe]}"),
                        gpu_memory_gib=80)
        planned = [f"{plan.trainer['total'] / GIB:.1f} GiB",
                   f"{plan.trainer['step_peak'] / GIB:.1f} GiB",
                   f"{plan.replica['total'] / GIB:.0f} GiB ({plan.kv_cache_tokens / 1000:.0f}k)",
                   f"{plan.trainers_per_replica:.1f}"]
        assert [cell.strip() for cell in cells.split("|")] == planned, recipe


VL_TARGET = "examples/targets/qwen2.5-vl-7b-instruct"


def vl_job(*overrides: str) -> JobConfig:
    return load_yaml(JobConfig, "examples/qwen2.5-vl-7b.yaml", list(overrides))


@pytest.fixture(scope="module")
def vl_model() -> torch.nn.Module:
    """Qwen2.5-VL-7B-Instruct as transformers builds it, on the meta device."""
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(VL_TARGET))


def test_the_vl_target_reads_as_the_published_checkpoint(vl_model):
    """The config is written flat, as the published one is; transformers 5 nests its text
    fields under text_config. 8.29B parameters, the published count."""
    config = AutoConfig.from_pretrained(VL_TARGET)
    text, vision = config.get_text_config(), config.vision_config
    assert (text.hidden_size, text.num_hidden_layers, text.num_attention_heads,
            text.num_key_value_heads, text.intermediate_size, text.vocab_size,
            text.max_position_embeddings) == (3584, 28, 28, 4, 18944, 152064, 128000)
    assert text.rope_parameters["mrope_section"] == [16, 24, 24] and text.dtype == torch.bfloat16
    assert (vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads,
            vision.out_hidden_size, vision.patch_size, vision.spatial_merge_size,
            vision.fullatt_block_indexes) == (32, 1280, 3420, 16, 3584, 14, 2, [7, 15, 23, 31])
    assert (config.image_token_id, config.tie_word_embeddings) == (151655, False)
    assert sum(p.numel() for p in vl_model.parameters()) == pytest.approx(8.29e9, rel=1e-3)


def test_a_vl_replica_holds_its_vision_tower_beside_the_language_model(vl_model):
    """The tower's weights (counted from the config) are transformers' tower's, in every
    replica; vLLM splits them across TP ranks as it splits the language model's, and not in
    its `mm_encoder_tp_mode: data`. They and the encoder's reserve come out of the KV cache."""
    visual = vl_model.model.visual
    tower = sum(p.numel() for p in visual.parameters())
    merger = sum(p.numel() for p in visual.merger.parameters())
    config = AutoConfig.from_pretrained(VL_TARGET)
    counts = parameter_counts(config)
    assert counts["vision"] == tower == 676_550_144
    assert counts["language"] == counts["active"] == sum(
        p.numel() for p in vl_model.parameters()) - tower
    # 2 FLOPs per tower parameter per patch, 4 patches per image token; the merger once.
    assert counts["vision_flops_per_image_token"] == 2 * (4 * (tower - merger) + merger)
    plan = plan_job(vl_job(), config, gpu_memory_gib=80)
    assert plan.replica["vision_weights"] == tower * 2
    assert plan.replica["weights"] == counts["language"] * 2
    rank = ("weights", "vision_weights", "activations", "cuda_graphs", "vision_encoder",
            "cuda_context")
    assert plan.replica["kv_cache"] == int(0.85 * 80 * GIB) - sum(plan.replica[k] for k in rank)
    split = plan_job(vl_job("target.tp_size=2"), config, gpu_memory_gib=80)
    assert split.replica["vision_weights"] == tower * 2 // 2
    whole = plan_job(vl_job("target.tp_size=2", "target.vllm_kwargs.mm_encoder_tp_mode=data"),
                     config, gpu_memory_gib=80)
    assert whole.replica["vision_weights"] == tower * 2
    assert "tower split by TP" in format_plan(split) and "whole on every rank" in \
        format_plan(whole)
    text_only = plan_job(load_yaml(JobConfig, "examples/qwen3-8b.yaml", []),
                         AutoConfig.from_pretrained("examples/targets/qwen3-8b"))
    assert "vision_weights" not in text_only.replica and "vision" not in text_only.assumptions


def test_the_encoders_reserve_is_for_the_images_vllms_profile_run_encodes():
    """The largest image's tokens are the processor's (transformers' own, on the size vLLM
    profiles with), the profile run encodes as many as vLLM's encoder budget holds, and a video
    is profiled unless the recipe turns it off."""
    from PIL import Image
    from transformers import AutoImageProcessor
    from vllm.config import SchedulerConfig
    from vllm.v1.core.encoder_cache_manager import compute_mm_encoder_budget

    config = AutoConfig.from_pretrained(VL_TARGET)
    processor = AutoImageProcessor.from_pretrained(VL_TARGET)
    cases = {(): (1003520, 1120, 896), ("target.vllm_kwargs.mm_processor_kwargs={}",):
             (12845056, 3584, 3584)}  # the recipe's cap; the preprocessor_config.json's
    for overrides, (pixels, width, height) in cases.items():
        v = plan_job(vl_job(*overrides), config, gpu_memory_gib=80).assumptions["vision"]
        grid = processor(images=Image.new("RGB", (width, height)), max_pixels=pixels,
                         return_tensors="pt")["image_grid_thw"]
        assert v["max_pixels"] == pixels and v["image_tokens"] == int(grid.prod()) // 4
        budget, _ = compute_mm_encoder_budget(SchedulerConfig(
            max_num_batched_tokens=16384, max_model_len=4097, is_encoder_decoder=False),
            {"image": v["image_tokens"]})
        assert v["profiled_items"] == budget // v["image_tokens"]
    assert (v["profiled_items"], v["profiled_item_tokens"]) == (1, 16384)
    v = plan_job(vl_job("target.vllm_kwargs.limit_mm_per_prompt={image: 1}"), config,
                 gpu_memory_gib=80).assumptions["vision"]
    # A video of 1,280-token frames, two per temporal patch: 3 grids fit 4,097 tokens.
    assert (v["profiled_item"], v["profiled_item_tokens"], v["profiled_items"]) == \
        ("video", 3 * 1280, 4)


def test_image_tokens_cost_a_replica_the_towers_flops_and_fill_the_routers_caps():
    """A row's image tokens (the recipe: one image of at most 1,280 of 4,096 tokens) cost the
    tower's FLOPs beside the language model's, so a replica serves fewer tokens per second and
    the router's cap holds more seconds of its work; more images per row, more so. vLLM's
    memory does not change with them (its profile run is sized by its budget)."""
    config = AutoConfig.from_pretrained(VL_TARGET)
    counts = parameter_counts(config)
    flops = DEFAULT_MFU * DEFAULT_GPU_TFLOPS * 1e12
    one = plan_job(vl_job(), config, gpu_memory_gib=80)
    v = one.assumptions["vision"]
    assert (v["image_tokens_per_row"], v["images_per_row_from"]) == (1280, "limit_mm_per_prompt")
    assert one.replica_tokens_per_s == pytest.approx(
        flops / (2 * counts["active"] + 1280 / 4096 * counts["vision_flops_per_image_token"]))
    # 31 % of the tokens at 1.34x a text token's FLOPs: 10 % fewer tokens/s than text alone.
    assert v["image_token_cost"] == pytest.approx(1.34, abs=0.005)
    assert one.replica_tokens_per_s / (flops / (2 * counts["active"])) == pytest.approx(
        0.90, abs=0.01)
    assert v["micro_batch_image_tokens"] == 2 * 1280  # data.micro_batch_size rows
    assert v["outstanding_s"] == pytest.approx(65536 / one.replica_tokens_per_s)
    two = plan_job(vl_job("target.vllm_kwargs.limit_mm_per_prompt={image: 2, video: 0}"),
                   config, gpu_memory_gib=80)
    w = two.assumptions["vision"]
    assert (w["image_tokens_per_row"], w["micro_batch_image_tokens"]) == (2560, 2 * 2560)
    assert two.replica_tokens_per_s < one.replica_tokens_per_s
    assert w["outstanding_s"] > v["outstanding_s"]
    assert two.replica == one.replica
    assert "up to 2,560 image tokens a row" in format_plan(two)


def test_an_image_longer_than_a_row_is_named_with_the_key_to_set():
    """The processor's own cap (16,384 tokens) cannot fit a 4,096-token row; the recipe's can."""
    config = AutoConfig.from_pretrained(VL_TARGET)
    default = plan_job(vl_job("target.vllm_kwargs.mm_processor_kwargs={}"), config,
                       gpu_memory_gib=80)
    assert re.search(r"WARNING: the largest image \(16,384 tokens.*max_pixels below 3,211,264",
                     format_plan(default))
    assert "WARNING" not in format_plan(plan_job(vl_job(), config, gpu_memory_gib=80))
