"""End to end: the pool feeds Ray Train workers, the draft learns, exports, and vLLM serves it.

One training run (module fixture) backs the assertions; a second run resumes from its checkpoint.
The target is the kit's pre-trained tiny Llama with Llama-3.1's context length (131,072
positions), and the job sets no vLLM option: the job sizes its engines
(`backends/sizing.py`), which sized from the checkpoint would not fit the CPU's KV budget.
"""

import contextlib
import copy
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from eagle_ray.bench.job import SHIPPED, summary_lines
from eagle_ray.config import JobConfig, load_yaml
from eagle_ray.tiny import tiny_target
from eagle_ray.train.job import run_job
from eagle_ray.train.report import (
    REPORT_SIZE_PX,
    TRAINING_ONLY_SIZE_PX,
    paired_deviation,
    vllm_agrees,
)

from pool_helpers import running_ray

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow

STEPS = 60


@functools.cache
def llama_3_1_shaped_target() -> Path:
    """The pre-trained tiny Llama, saying `max_position_embeddings: 131072` as Llama-3.1 does
    (the same weights: the rotary embedding does not read it)."""
    path = Path(tempfile.mkdtemp(prefix="llama-3.1-shaped-")) / "target"
    shutil.copytree(tiny_target("llama", pretrained=True), path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 131072}))
    return path


def job(output_dir, *overrides: str) -> JobConfig:
    """The main job's config (examples/tiny.yaml), shortened for a test, on the Llama-3.1-shaped
    tiny target (no vLLM setting)."""
    return load_yaml(JobConfig, ROOT / "examples" / "tiny.yaml", [
        f"target.model_path={llama_3_1_shaped_target()}", "target.name=train-test",
        "target.namespace=eagle_ray_test", "data.num_samples=200",
        "data.eval_samples=8", f"train.steps={STEPS}", "train.checkpoint_every=30",
        "train.log_every=10", "train.warmup_steps=10", "eval.prompts=6",
        "eval.max_new_tokens=24", f"output_dir={output_dir}", "run_name=train-test",
        "train.loggers=[tensorboard,mlflow]", *overrides])


@pytest.fixture(scope="module")
def local_ray():
    with running_ray(object_store_mb=400):
        yield


@contextlib.contextmanager
def models_built_in_this_process():
    """Yields a list of every transformers model and vLLM engine constructed in this process
    (the driver's) while it lasts."""
    import transformers
    from vllm import LLM

    built: list[str] = []

    def watched(cls, name):
        original = cls.__init__

        def init(self, *args, **kwargs):
            built.append(f"{name} {type(self).__name__}")
            original(self, *args, **kwargs)
        return init

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(transformers.PreTrainedModel, "__init__",
                      watched(transformers.PreTrainedModel, "transformers"))
        patch.setattr(LLM, "__init__", watched(LLM, "vLLM"))
        yield built


@pytest.fixture(scope="module")
def trained(local_ray, tmp_path_factory):
    """The job, run with its driver (this process) watched for model loading."""
    output_dir = tmp_path_factory.mktemp("train")
    with models_built_in_this_process() as built:
        summary = run_job(job(output_dir))
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return output_dir, {**summary, "models_built_in_the_driver": built}, metrics


def test_the_driver_loads_no_model_the_evaluation_runs_where_the_target_would(trained):
    """The driver runs on the head, which has neither GPUs nor the memory for a target: the
    replicas, the trainers and the evaluation (a Ray task with a replica's resources) load
    every model; the driver reads configs and the tokenizer only."""
    _, summary, _ = trained
    assert summary["models_built_in_the_driver"] == []
    assert summary["eval"]["vllm"] and summary["eval"]["simulated"], "it evaluated, elsewhere"


def test_the_driver_watch_sees_a_model_built_in_this_process(qwen3_path):
    """The control: the watch above records what the driver would load."""
    from transformers import AutoModelForCausalLM

    with models_built_in_this_process() as built:
        AutoModelForCausalLM.from_pretrained(qwen3_path)
    assert built == ["transformers Qwen3ForCausalLM", "transformers Qwen3Model"]


def test_loss_decreases_and_accuracy_rises(trained):
    _, _, metrics = trained
    assert [m["step"] for m in metrics] == list(range(10, STEPS + 1, 10))
    assert metrics[-1]["loss_0"] < 0.85 * metrics[0]["loss_0"], [m["loss_0"] for m in metrics]
    assert metrics[-1]["acc_0"] > metrics[0]["acc_0"]
    assert all(0 <= m["pool_wait_share"] <= 1 and 0 <= m["data_wait_share"] <= 1
               and m["supervision_tokens_per_s"] > 0 for m in metrics)
    # Token-budget micro-batches of length-bucketed rows: little padding.
    assert all(0 <= m["padding_share"] < 0.2 for m in metrics), [m["padding_share"]
                                                                 for m in metrics]


def test_training_answers_are_the_targets_own(trained):
    output_dir, summary, _ = trained
    report = summary["regenerated"]
    assert report["failed"] == 0 and report["conversations"] == summary["data"]["kept"]
    assert report["changed_share"] > 0.5, "the generated data's answers are not the target's"
    assert Path(report["file"]).parent == output_dir


def test_trained_draft_beats_an_untrained_one_in_simulation_and_in_vllm(trained):
    _, summary, _ = trained
    report = summary["eval"]
    assert report["prompts"] == 6 and report["failed_prompts"] == 0
    simulated = {r["num_speculative_tokens"]: r for r in report["simulated"]
                 if r["temperature"] == 0}
    measured = {(r["num_speculative_tokens"], r["temperature"]): r for r in report["vllm"]}
    assert sorted(simulated) == [3, 7] and sorted(measured) == [(3, 0.0), (3, 1.0), (7, 0.0),
                                                                (7, 1.0)]
    for k, sim in simulated.items():
        assert sim["untrained"] < sim["trained"], k
        greedy = measured[k, 0.0]
        # vLLM serving the exported draft as eagle3: clearly above the untrained draft ...
        assert greedy["mean_acceptance_length"] > sim["untrained"] + 0.05, k
        # ... in agreement with the project's own simulation on the same turns ...
        assert abs(greedy["mean_acceptance_length"] - sim["trained"]) < 0.05, k
        # ... and speculation never changes greedy output.
        assert greedy["greedy_equal_fraction"] == 1.0, k
        assert len(greedy["acceptance_per_position"]) == k
    for row in measured.values():  # sampled too, each with its interval over the prompts
        low, high = row["interval_95"]
        assert row["prompts"] == 6 and row["failed"] == 0 and row["verify_steps"] > 0
        assert low <= row["mean_acceptance_length"] <= high
    # Sampled: the kit's target is unsure of its phrasing, so temperature 1 accepts less than
    # greedy; the draft still works, and vLLM (its CPU sampler fixed by eagle_ray's plugin:
    # docs/training.md) agrees with the exact expectation on its own answers.
    assert 0.6 <= report["target_top_probability"] <= 0.85, report["target_top_probability"]
    sampled = {r["num_speculative_tokens"]: r for r in report["simulated"]
               if r["temperature"] == 1.0}
    assert sorted(sampled) == [3, 7]
    for k, row in sampled.items():
        assert row["trained"] > row["untrained"] + 0.5, row
        assert row["trained_expected"] < simulated[k]["trained"] - 0.1, (row, simulated[k])
        _vllm_samples_as_the_exact_model_says(measured[k, 1.0], row)


def _vllm_samples_as_the_exact_model_says(measured: dict, simulated: dict) -> None:
    """vLLM's sampled answers replayed with the draft: at every verify step of every answer vLLM
    drafted what the draft drafts (each answer's replayed steps are as many as its counters
    hold: CPU, fp32), and vLLM's length lies within AGREEMENT_Z standard errors of the exact
    expectation on those answers. The control: the same figure 10 % lower is flagged (the check
    has the power: eval.samples_per_prompt)."""
    paired = simulated["trained_on_vllm_answers"]
    assert paired["answers_with_vllms_steps"] == paired["answers"] >= 6 * 24, paired
    assert paired["verify_steps"] == paired["vllm_verify_steps"] == measured["verify_steps"]
    assert vllm_agrees(measured, simulated), (measured, paired)
    under = {**measured, "mean_acceptance_length": 0.9 * measured["mean_acceptance_length"]}
    assert not vllm_agrees(under, simulated), (paired_deviation(under, paired), paired)


def test_the_job_benchmark_reports_what_the_summary_says(trained):
    """`eagle-ray bench job` (a job per arm; too long for CI) turns each job's summary into its
    lines: checked on this job's real summary, against a variant whose vLLM figures halve."""
    _, summary, _ = trained
    shipped = summary_lines(SHIPPED, summary, summary)
    assert not any("ratio" in line for line in shipped), "the baseline compares with nothing"
    vllm = {(r["num_speculative_tokens"], f"{r['temperature']:g}"): r["mean_acceptance_length"]
            for r in summary["eval"]["vllm"]}
    lines = {(line["k"], line["temperature"]): line for line in shipped
             if line["metric"] == "vllm_acceptance_length"}
    assert {key: line["value"] for key, line in lines.items()} == pytest.approx(vllm, abs=1e-4)
    halved = copy.deepcopy(summary)
    for row in halved["eval"]["vllm"]:
        row["mean_acceptance_length"] /= 2
    variant = [line for line in summary_lines("fp8 supervision", halved, summary)
               if line["metric"] == "vllm_acceptance_length"]
    assert len(variant) == 4 and all(line["ratio"] == pytest.approx(0.5, abs=1e-3)
                                     for line in variant)
    exact = {(line["k"], line["temperature"]): line["value"] for line in shipped
             if line["metric"] == "exact_acceptance_length"}
    assert exact[3, "1"] == pytest.approx(next(
        r["trained_on_vllm_answers"]["expected"] for r in summary["eval"]["simulated"]
        if (r["num_speculative_tokens"], r["temperature"]) == (3, 1.0)), abs=1e-4)


def test_export_is_a_servable_draft_folder(trained):
    output_dir, summary, _ = trained
    config = json.loads((output_dir / "draft" / "config.json").read_text())
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # canonical [1, 3, 4] + 1
    assert config["draft_vocab_size"] == 256
    assert (output_dir / "draft_vocab.json").exists()
    assert summary["data"]["truncated"] == summary["data"]["dropped_no_answer"] == 0
    # Held out: the first 8 conversations and their duplicates elsewhere in the data.
    assert 0 < summary["data"]["kept"] <= 200 - 8


def test_rerun_resumes_the_step_count_and_the_loss_curve(trained):
    output_dir, _, first = trained
    # The HF backend (quick to start): the supervision equals vLLM's, resuming is the subject.
    run_job(job(output_dir, f"train.steps={STEPS + 20}", "eval.enabled=false",
                "target.backend=hf"))
    metrics = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    resumed = metrics[len(first):]
    assert [m["step"] for m in resumed] == [STEPS + 10, STEPS + 20]
    assert resumed[0]["loss_0"] < 0.9 * first[0]["loss_0"], "continues, not restarts"


def test_a_rerun_that_changes_what_the_draft_learns_is_refused(trained, qwen3_path):
    """Same run_name, another seed: refused before any pool starts, naming the change; another
    target: refused once the pool says what it serves. Neither touches the run."""
    from eagle_ray.config import ConfigError

    output_dir = trained[0]
    before = (output_dir / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"train\.seed: 0 -> 1\).*another run_name"):
        run_job(job(output_dir, "train.seed=1"))
    with pytest.raises(ConfigError, match=r"trained on .*fingerprint: .* -> "):
        run_job(job(output_dir, f"target.model_path={qwen3_path}", "target.backend=hf"))
    assert (output_dir / "metrics.jsonl").read_text() == before


def test_report_png_is_written(trained):
    output_dir, summary, _ = trained
    from PIL import Image

    with Image.open(output_dir / "report.png") as image:
        image.verify()  # a complete, valid PNG
    with Image.open(output_dir / "report.png") as image:
        # The last run of the folder wrote it: the evaluated one, or a rerun without evaluation
        # (test_rerun_resumes_the_step_count_and_the_loss_curve).
        assert image.format == "PNG" and image.size in (REPORT_SIZE_PX, TRAINING_ONLY_SIZE_PX)
    assert summary["report"] == str(output_dir / "report.png")


def test_tensorboard_scalars_match_the_metrics_file(trained):
    output_dir, _, metrics = trained
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(output_dir / "tensorboard"))
    events.Reload()
    for name in ("loss_0", "acc_2", "supervision_tokens_per_s", "pool_wait_share"):
        logged = [(e.step, e.value) for e in events.Scalars(name)][:len(metrics)]
        assert [step for step, _ in logged] == [m["step"] for m in metrics]
        assert [value for _, value in logged] == pytest.approx([m[name] for m in metrics],
                                                               rel=1e-6)


def test_mlflow_run_in_the_local_folder_has_the_metrics(trained):
    output_dir, _, metrics = trained
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient((output_dir / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("eagle_ray")
    # The first run (the resumed one that follows logs as another run).
    run = client.search_runs([experiment.experiment_id], order_by=["attributes.start_time"])[0]
    assert run.data.tags["mlflow.runName"] == "train-test"
    assert run.data.params["train.steps"] == str(STEPS)
    history = client.get_metric_history(run.info.run_id, "loss_0")
    assert [(h.step, h.value) for h in history] == [
        (m["step"], pytest.approx(m["loss_0"], rel=1e-6)) for m in metrics]


def test_the_printed_serve_command_serves_what_the_evaluation_served(trained):
    """The command is the one the evaluation's engine was built from (`DraftServing`: target,
    dtype, tensor-parallel size, speculative config), where vLLM loaded and ran the draft as an
    EAGLE-3 draft."""
    from eagle_ray.draft.serving import DraftServing

    _, summary, _ = trained
    served_with = DraftServing(**summary["eval"]["served_with"])
    assert summary["serve_command"] == served_with.command(3)
    words = shlex.split(summary["serve_command"])
    assert words[:3] == ["vllm", "serve", summary["target"]["model_path"]]
    options = dict(zip(words[3::2], words[4::2], strict=True))
    assert options["--dtype"] == "float32"  # the target's dtype (the job's target.dtype)
    spec = json.loads(options["--speculative-config"])
    assert spec == served_with.speculative_config(3) and spec["method"] == "eagle3"
    assert spec["model"] == summary["draft_dir"]
    assert summary["eval"]["vllm"][0]["mean_acceptance_length"] > 1.0  # vLLM drafted with it


def assert_counted_every_verify_step(report) -> None:
    """Each vLLM row's draft forwards were counted in its engine over the proposals vLLM
    verified: one per verify step of its spec-decode counters, and one more at most per request
    (the last drafts of a request are never verified; a turn is a request per sampled answer)."""
    for row in report["vllm"]:
        counts = row["draft_forwards"]
        requests = report["turns"] * row.get("answers_per_prompt", 1)
        assert row["verify_steps"] <= counts["requests"] <= row["verify_steps"] + requests


def test_vllm_ran_k_chained_draft_forwards_per_verify_step_for_eagle3(trained):
    """The chain's figure, counted in vLLM's engine (a Ray task's processes): k forwards per
    verify step at k = 3 and 7, over both temperatures; the parallel kinds' (one) below, the
    counter on a draft run against its kind: tests/backends/test_draft_forwards.py."""
    _, summary, _ = trained
    report = summary["eval"]
    assert report["draft"]["forwards_per_verify_step"] == {"3": 3.0, "7": 7.0}
    assert report["draft"]["drafts_as_its_kind"] is True
    assert_counted_every_verify_step(report)


def assert_served_in_one_pass(report, kind: str) -> None:
    """A parallel draft's evaluation at k = 3: one draft forward per verify step (counted in
    vLLM's engine; timed in the simulation), vLLM serving it leaves greedy output unchanged,
    agrees with the simulation and accepts more than the untrained draft."""
    assert report["draft"]["kind"] == kind
    assert report["draft"]["forwards_per_verify_step"] == {"3": 1.0}  # one pass, not k
    assert report["draft"]["drafts_as_its_kind"] is True
    assert_counted_every_verify_step(report)
    assert report["draft"]["seconds_per_verify_step"]["3"] > 0
    (greedy,), (simulated,) = report["vllm"], report["simulated"]
    assert greedy["greedy_equal_fraction"] == 1.0
    assert abs(greedy["mean_acceptance_length"] - simulated["trained"]) < 0.05, (greedy,
                                                                                 simulated)
    assert greedy["mean_acceptance_length"] > simulated["untrained"] + 0.3


# What the other draft kinds' jobs change from the main job's: the kind, trained and served, is
# their subject. The pool on the HF backend (quick to start: its supervision equals vLLM's,
# tests/backends/test_vllm_target.py, and it regenerates the answers as well: the draft learns
# on the target's own); vLLM serves each export at k = 3, greedy.
A_KIND_OF_DRAFT = ("target.backend=hf", "train.loggers=[]", "eval.num_speculative_tokens=[3]",
                   "eval.temperatures=[0.0]")


def test_a_peagle_draft_trains_exports_and_vllm_drafts_with_it_in_parallel(local_ray,
                                                                          tmp_path):
    """`draft.kind: peagle` (two layers) through the same job: the export carries what vLLM's
    parallel drafting reads, the printed command turns it on, vLLM serving it leaves greedy
    output unchanged, agrees with the simulation and accepts more than the untrained draft."""
    output_dir = tmp_path / "peagle"
    summary = run_job(job(output_dir, "draft.kind=peagle", "draft.num_layers=2",
                          "run_name=peagle-test", "train.ttt_steps=3", "train.workers=1",
                          *A_KIND_OF_DRAFT))
    config = json.loads((output_dir / "draft" / "config.json").read_text())
    assert config["eagle_ray_draft_kind"] == "peagle" and config["num_aux_hidden_states"] == 3
    assert config["num_hidden_layers"] == 2
    assert config["mask_token_id"] == 0  # the kit's pad token: its vocabulary has no free id
    assert '"parallel_drafting": true' in summary["serve_command"]
    assert_served_in_one_pass(summary["eval"], "peagle")


def test_a_dflash_draft_trains_exports_and_vllm_drafts_a_block_with_it(local_ray, tmp_path):
    """`draft.kind: dflash` on five target layers through the same job: the export is what
    vLLM's `dflash` method loads, the printed command names that method, vLLM serving it leaves
    greedy output unchanged, agrees with the simulation and accepts more than the untrained
    draft."""
    output_dir = tmp_path / "dflash"
    summary = run_job(job(output_dir, "draft.kind=dflash", "draft.num_layers=2",
                          "target.aux_layer_ids=[1,2,3,4,5]",
                          "run_name=dflash-test", "train.ttt_steps=3", *A_KIND_OF_DRAFT))
    config = json.loads((output_dir / "draft" / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and config["block_size"] == 4
    assert config["dflash_config"] == {"mask_token_id": 0, "target_layer_ids": [1, 2, 3, 4, 5]}
    assert '"method": "dflash"' in summary["serve_command"]
    assert_served_in_one_pass(summary["eval"], "dflash")


def test_sampling_near_temperature_zero_simulates_the_greedy_acceptance(trained):
    """The sampled simulation's oracle: as the temperature goes to 0 the target's distribution
    becomes its argmax, so speculative sampling accepts exactly what greedy drafting does."""
    import torch

    from eagle_ray.backends.hf import HFEagle3TargetModel
    from eagle_ray.data.chat import prompt_for_turn, stop_token_ids
    from eagle_ray.draft.export import exported_target, load_exported_draft
    from eagle_ray.evaluation.evaluate import greedy_generate
    from eagle_ray.evaluation.simulate import simulate_acceptance, simulate_sampled_acceptance
    from eagle_ray.tiny import generate_chat_samples

    _, summary, _ = trained
    served = exported_target(summary["draft_dir"])
    target = HFEagle3TargetModel.from_pretrained(
        served.model_path, aux_layer_ids=list(served.aux_layer_ids), dtype=torch.float32)
    draft, vocab = load_exported_draft(summary["draft_dir"],
                                       target.get_input_embeddings().weight.detach())
    tokenizer = AutoTokenizer.from_pretrained(served.model_path)
    prompts = [prompt_for_turn(tokenizer, s["messages"], 2)
               for s in generate_chat_samples(4, seed=321)]
    stops = stop_token_ids(tokenizer)
    greedy = simulate_acceptance(target, draft.eval(), vocab, prompts,
                                 [greedy_generate(target, p, 24, stops) for p in prompts], 3)
    sampled = simulate_sampled_acceptance(target, draft, vocab, prompts, 3, 1e-4, 24, stops)
    assert sampled[0] == pytest.approx(greedy[0], abs=0.05) and greedy[0] > 1.5, (greedy, sampled)
    hot = simulate_sampled_acceptance(target, draft, vocab, prompts, 3, 20.0, 24, stops)
    assert hot[0] < greedy[0] - 0.5, "a flat target accepts little: the control"


def test_eval_answers_mt_bench_turn_by_turn_from_the_command_line(trained, tmp_path):
    """`eagle-ray eval --draft DIR --prompts FILE`: two-turn MT-Bench lines and a GSM8K line,
    each turn answered by vLLM with the draft, greedy output unchanged; an unreadable line is
    counted, not dropped silently."""
    _, summary, _ = trained
    prompts = tmp_path / "mt_bench.jsonl"
    prompts.write_text("\n".join([
        json.dumps({"question_id": 1, "turns": ["What is the capital of Peru?",
                                                "And of Kenya?"]}),
        json.dumps({"question_id": 2, "turns": ["What is two plus three?", "And plus one?"]}),
        json.dumps({"question": "Describe a red car in one sentence.", "answer": "-"}),
        "{not json"]) + "\n")
    command = [str(Path(sys.executable).parent / "eagle-ray"), "eval", "--draft",
               summary["draft_dir"], "--prompts", str(prompts), f"output_dir={tmp_path}",
               "eval.num_speculative_tokens=[3]", "eval.temperatures=[0.0]",
               "eval.max_new_tokens=12"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["prompts"] == 3 and report["turns"] == 5
    assert report["skipped_lines"] == {"not JSON": 1} and report["failed_prompts"] == 0
    [row] = report["vllm"]
    assert row["prompts"] == 3 and row["verify_steps"] > 0
    assert row["greedy_equal_fraction"] == 1.0, "all five turns kept the greedy answer"


def test_a_supervision_cache_trains_without_a_pool_and_refuses_another_target(
        local_ray, tmp_path, monkeypatch, qwen3_path):
    """`eagle-ray cache` writes the pool's supervision (fp8; an HF pool, quick to start: fp8 is
    encoded the same for every backend); training from it starts no pool and reads no data, and
    a job meant for another target refuses the cache."""
    import torch

    from eagle_ray.config import ConfigError
    from eagle_ray.data.cache_job import run_cache
    from eagle_ray.data.supervision_cache import SupervisionCache
    from eagle_ray.train import job as train

    cached = ["data.num_samples=60", "regenerate.enabled=false", "eval.enabled=false",
              "target.backend=hf",
              "train.loggers=[]", "train.steps=6", "train.log_every=3",
              "train.checkpoint_every=6", "run_name=from-cache", "target.encoding_dtype=fp8",
              f"data.supervision_cache={tmp_path / 'cache'}"]
    summary = run_cache(job(tmp_path / "write", *cached))
    cache = SupervisionCache.open(tmp_path / "cache")
    assert summary["micro_batches"] == len(cache) >= 2 and cache.index["encoding_dtype"] == "fp8"
    assert cache.index["statuses"]["kept"] > 0 and len(cache.index["held_out"]) == 8
    stored = cache.read(0)
    assert stored.aux_hidden_states.dtype == torch.float32, "dequantised to the engine's dtype"
    assert bool((stored.aux_hidden_states[stored.attention_mask.bool()].abs().sum(-1) > 0).all())

    def no_pool(config):
        raise AssertionError("training from a supervision cache started a pool")
    monkeypatch.setattr(train, "job_pool", no_pool)
    result = run_job(job(tmp_path / "train", *cached))
    assert result["final_metrics"]["step"] == 6
    metrics = train.read_metrics(tmp_path / "train")
    assert [m["step"] for m in metrics] == [3, 6] and all(m["loss_0"] > 0 for m in metrics)
    assert torch.isfinite(torch.tensor([m["loss"] for m in metrics])).all()
    with pytest.raises(ConfigError, match="another checkpoint"):
        run_job(job(tmp_path / "other", *cached, f"target.model_path={qwen3_path}"))
    with pytest.raises(ConfigError, match="aux_layer_ids"):
        run_job(job(tmp_path / "other", *cached, "target.aux_layer_ids=[0,1,2]"))
