"""From a checkpoint folder and a chat file to a draft vLLM serves, for checkpoints shaped like the
targets people train drafts for: Qwen3 (padded vocabulary, thinking blocks), Mistral-Instruct and
the mixture-of-experts Qwen3-MoE and Mixtral, each with its stock chat template (the Llama
architecture goes this way in test_train, the Llama-3.1 template is rendered and masked in
test_chat_templates). Also: a job joining a shared pool must train for what it serves (a job
adopting the pool's settings: test_job_submit).
"""

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.config import ConfigError, JobConfig, PoolConfig, load_yaml
from eagle_ray.contract.identity import checkpoint_fingerprint
from eagle_ray.data.chat import read_conversations, stop_token_ids
from eagle_ray.draft.export import exported_target
from eagle_ray.draft.serving import DraftServing
from eagle_ray.evaluation.acceptance import vllm_acceptance_table
from eagle_ray.evaluation.evaluate import GreedyAnswers
from eagle_ray.evaluation.prompts import EvalPrompt
from eagle_ray.pool import TargetPool
from eagle_ray.tiny import generate_chat_samples
from eagle_ray.train.job import run_job

from pool_helpers import running_ray

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def local_ray():
    with running_ray(object_store_mb=400, namespace="eagle_ray_test"):
        yield


def write_chats(path, num: int = 48, thinking: bool = False):
    """Two-turn chats with a system prompt; every other line in ShareGPT's shape."""
    rng = random.Random(0)
    samples = generate_chat_samples(2 * num, seed=3)
    with open(path, "w") as f:
        for i in range(num):
            first, second = samples[2 * i]["messages"], samples[2 * i + 1]["messages"]
            answer = second[2]["content"]
            if thinking and rng.random() < 0.5:
                answer = f"<think>\nThe user asks: {second[1]['content']}\n</think>\n\n{answer}"
            messages = [*first, second[1], {"role": "assistant", "content": answer}]
            if i % 2:
                names = {"system": "system", "user": "human", "assistant": "gpt"}
                line = {"conversations": [{"from": names[m["role"]], "value": m["content"]}
                                          for m in messages]}
            else:
                line = {"messages": messages}
            f.write(json.dumps(line) + "\n")
    return path


def job(tmp_path, *overrides: str) -> JobConfig:
    return load_yaml(JobConfig, ROOT / "examples" / "tiny.yaml", [
        "train.workers=1", "train.steps=4", "train.log_every=2", "train.checkpoint_every=4",
        "train.warmup_steps=1", "data.micro_batch_size=4", "data.draft_vocab_size=128",
        "data.eval_samples=4", "eval.enabled=false", "target.namespace=eagle_ray_test",
        "regenerate.enabled=false",  # random-weight checkpoints: their answers teach nothing
        f"output_dir={tmp_path / 'run'}", f"storage_path={tmp_path / 'results'}", *overrides])


# The pool's backend per family: vLLM where no other test runs that architecture through the
# vLLM backend inside a job (the padded Qwen3 is checked against HF in test_vllm_target, the MoE
# ones in test_moe_targets); the HF backend elsewhere saves an engine start. vLLM serves every
# family's export below (Mixtral through eagle_ray's vLLM plugin, backends/vllm/plugin.py).
@pytest.mark.parametrize(("family", "backend"), [("qwen3", "hf"), ("mistral", "vllm"),
                                                 ("qwen3_moe", "vllm"), ("mixtral", "hf")])
def test_train_export_and_serve_with_the_stock_template(local_ray, family_checkpoints, family,
                                                        backend, tmp_path):
    model_path = family_checkpoints[family]
    data = write_chats(tmp_path / "chats.jsonl", thinking=family.startswith("qwen3"))
    summary = run_job(job(tmp_path, f"target.model_path={model_path}", f"data.path={data}",
                          f"target.backend={backend}",
                          f"target.name=real-{family.replace('_', '-')}", f"run_name={family}"))

    # Every conversation rendered with the stock template and kept (48 minus 4 held out).
    assert summary["data"]["kept"] == 44 and summary["data"]["dropped_no_answer"] == 0
    draft_dir = tmp_path / "run" / "draft"
    exported = json.loads((draft_dir / "config.json").read_text())
    served = exported_target(draft_dir)
    target_config = json.loads((model_path / "config.json").read_text())
    assert exported["vocab_size"] == served.vocab_size == target_config["vocab_size"]
    assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # canonical [1, 3, 4]
    assert served.fingerprint == checkpoint_fingerprint(model_path)

    # vLLM serves the export as the target's EAGLE-3 draft, and speculation keeps greedy output.
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    held_out = [EvalPrompt.from_conversation(messages)
                for _, messages in read_conversations(data)][-2:]
    stops = stop_token_ids(tokenizer)
    hf = HFEagle3TargetModel.from_pretrained(model_path, dtype=torch.float32)
    serving = DraftServing(str(model_path), str(draft_dir), "float32")
    [row] = vllm_acceptance_table(serving, held_out, tokenizer, [3], [0.0], 8, stops,
                                  reference=GreedyAnswers(hf, 8, stops))
    assert row["verify_steps"] > 0 and row["failed"] == 0
    assert row["greedy_equal_fraction"] == 1.0


@pytest.fixture(scope="module")
def shared_pool(local_ray, llama_path):
    """A pool serving the tiny Llama with non-default aux ids (HF backend: quick to start)."""
    pool = TargetPool.create(PoolConfig(backend="hf", model_path=str(llama_path),
                                        dtype="float32", aux_layer_ids=[0, 2, 5],
                                        name="shared-ids", namespace="eagle_ray_test"))
    yield pool
    pool.shutdown()


@pytest.mark.parametrize("setting", ["target.aux_layer_ids=[1, 3, 4]", "target.model_path={qwen3}"])
def test_a_job_for_another_target_than_the_pool_serves_stops_before_training(
        shared_pool, qwen3_path, tmp_path, setting):
    config = job(tmp_path, "use_shared_pool=true", "target.name=shared-ids",
                 setting.format(qwen3=qwen3_path))
    with pytest.raises(ConfigError, match="the pool 'shared-ids' serves .* but target"):
        run_job(config)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert not (tmp_path / "results").exists(), "no Ray Train run started"

