"""`eagle-ray plan`: the trainer's memory measured on fake tensors matches a real step, the
shipped GPU recipes fit an 80 GB GPU with headroom, and a GPU too small for a trainer or a
replica is refused (by the plan, before training, and by each worker on its own GPU)."""

import re
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from eagle_ray.cli import main
from eagle_ray.config import JobConfig, load_yaml
from eagle_ray.contract.supervision import DraftVocab, draft_target
from eagle_ray.contract.target_head import TargetHead
from eagle_ray.draft.kinds import build_draft
from eagle_ray.draft.model import DraftConfig
from eagle_ray.plan import (
    GIB,
    TRAINER_SHARE,
    check_job_fits,
    check_replica_fits,
    check_trainer_fits,
    check_worker_memory,
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
           "llama3.1-8b-dflash": "llama-3.1-8b-instruct"}


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
    hidden = AutoConfig.from_pretrained(f"examples/targets/{RECIPES[recipe]}").hidden_size
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


def test_the_gpu_memory_is_the_one_named_else_the_one_present(monkeypatch):
    assert gpu_memory(24) == (24.0, "configured")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    memory, source = gpu_memory()
    assert memory == 80 and source.startswith("assumed")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (3 * GIB, 22.5 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "NVIDIA L4")
    assert gpu_memory() == (22.5, "measured (NVIDIA L4)")
    job = load_yaml(JobConfig, "examples/llama3.1-8b.yaml", [])
    assert plan_job(job, AutoConfig.from_pretrained(LLAMA_8B)).assumptions["gpu_memory_gib"] \
        == 22.5


def test_a_trainer_worker_too_big_for_its_gpu_is_refused():
    job = load_yaml(JobConfig, "examples/llama3.1-8b.yaml", [])
    target = AutoConfig.from_pretrained(LLAMA_8B)
    check_trainer_fits(plan_job(job, target, gpu_memory_gib=80))  # the control
    with pytest.raises(ValueError, match=r"over its 19.2 GiB budget \(80% of a 24 GiB GPU, "
                                         r"configured\): lower data.micro_batch_size"):
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


def test_the_train_time_gate_stops_a_job_that_does_not_fit(tmp_path):
    """`run_job` refuses before Ray or a pool starts; every worker checks its own GPU again."""
    from eagle_ray.tiny import tiny_target
    from eagle_ray.train.job import check_job_memory, run_job

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
