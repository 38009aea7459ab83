"""A Ray Train worker SIGKILLed mid-job: the job resumes from its last checkpoint by itself
(`train.max_failures`), says so in the driver's log (the console and job.log), and
metrics.jsonl keeps one record per step. The resume is exact: the row ledger (rows.jsonl) lists
the micro-batches an uninterrupted run trains, each once, in its order -- computed here from the
data itself -- and so does a rerun that resumes the two workers' run mid-epoch with one.

The moment is the test's: the pool's target (the HF backend behind a gate) holds every call
while the gate file exists, so the worker is killed after a checkpoint and before the job can
end, whatever the machine's speed.
"""

import itertools
import json
import logging
import os
import signal
import threading
from pathlib import Path

import psutil
import pytest
from transformers import AutoTokenizer

from eagle_ray.config import JobConfig, load_yaml
from eagle_ray.data.chat import conversation_key
from eagle_ray.data.ingest import GENERATED_WRITER
from eagle_ray.data.order import DataOrder
from eagle_ray.data.tokenize import TRAINED, tokenize_row
from eagle_ray.tiny import generate_chat_samples, tiny_target
from eagle_ray.train.job import run_job
from eagle_ray.train.ledger import LEDGER_FILE

from pool_helpers import running_ray, wait_until

ROOT = Path(__file__).resolve().parents[2]
# 18 steps of two workers end mid-epoch (an epoch of the 60 rows is 8 micro-batches).
STEPS, CHECKPOINT_EVERY, LOG_EVERY, MORE_STEPS = 18, 5, 5, 4

pytestmark = pytest.mark.slow


def train_worker_pids() -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if "RayTrainWorker" in " ".join(p.info["cmdline"] or [])]


def registered_checkpoint(run_storage: Path) -> bool:
    """Whether Ray Train's checkpoint manager has registered a checkpoint (written into its
    snapshot): what a restarted worker group resumes from."""
    snapshot = run_storage / "checkpoint_manager_snapshot.json"
    try:
        return json.loads(snapshot.read_text()).get("latest_checkpoint_result") is not None
    except (OSError, ValueError):
        return False


def expected_order(config: JobConfig, seed: int | None = None) -> DataOrder:
    """The order an uninterrupted run of `config` trains in (with another `seed`: the control),
    from the data: row ids are the training rows' ranks by conversation key
    (`eagle_ray.data.row_store`), packed as `eagle_ray.data.order` says."""
    tokenizer = AutoTokenizer.from_pretrained(config.target.model_path)
    samples = generate_chat_samples(config.data.num_samples, writer=GENERATED_WRITER)
    held = {conversation_key(s["messages"]) for s in samples[:config.data.eval_samples]}
    rows = sorted((conversation_key(s["messages"]), tokenize_row(
        tokenizer, s["messages"], config.data.max_length, len(tokenizer), config.data.overlong,
        "a test row")) for s in samples)
    lengths = [len(ids) for key, (status, ids, _) in rows if status in TRAINED and key not in held]
    return DataOrder.for_job(lengths, config.data,
                             config.train.seed if seed is None else seed)


def uninterrupted(order: DataOrder, micro_batches: int) -> list[tuple[int, list[int]]]:
    return list(itertools.islice(order.shard(0, 0, 1), micro_batches))


def ledger(output_dir: Path) -> tuple[list[int], list[tuple[int, list[int]]]]:
    """The steps rows.jsonl lists, and `(position, row ids)` of each micro-batch they trained,
    in training order."""
    lines = [json.loads(line) for line in (output_dir / LEDGER_FILE).read_text().splitlines()]
    return [line["step"] for line in lines], [
        item for line in lines for item in zip(line["positions"], line["rows"], strict=True)]


def mid_epoch(order: DataOrder, position: int) -> bool:
    ends = itertools.accumulate(len(order.epoch(e)) for e in itertools.count())
    return next(end for end in ends if end >= position) != position


def start(config: JobConfig) -> tuple[threading.Thread, dict]:
    """`run_job(config)` in a thread; the dict gets its summary or its error."""
    outcome: dict = {}

    def job() -> None:
        try:
            outcome["summary"] = run_job(config)
        except BaseException as e:  # noqa: BLE001 -- the assertion below shows it
            outcome["error"] = e

    thread = threading.Thread(target=job)
    thread.start()
    return thread, outcome


def test_a_killed_worker_resumes_its_checkpoint_one_record_per_step_and_the_same_rows(
        tmp_path, caplog):
    gate = tmp_path / "hold"
    overrides = [
        f"target.model_path={tiny_target('llama', pretrained=True)}",
        "target.backend=eagle_ray.testing:gated_hf_target",
        f"target.backend_kwargs={{hold_while: {gate}}}", "target.name=recovery-test",
        "target.namespace=eagle_ray_test", "data.num_samples=64", "data.eval_samples=4",
        "regenerate.enabled=false", "eval.enabled=false", f"train.steps={STEPS}",
        f"train.checkpoint_every={CHECKPOINT_EVERY}", f"train.log_every={LOG_EVERY}",
        "train.warmup_steps=5", "train.max_failures=2", f"output_dir={tmp_path / 'run'}",
        "run_name=recovery-test"]
    config = load_yaml(JobConfig, ROOT / "examples" / "tiny.yaml", overrides)
    order = expected_order(config)
    caplog.set_level(logging.WARNING, logger="eagle_ray")
    with running_ray(object_store_mb=400):
        thread, outcome = start(config)
        wait_until(lambda: registered_checkpoint(tmp_path / "run" / "ray_results"
                                                 / "recovery-test"),
                   timeout_s=600, what="a checkpoint Ray Train registered")
        gate.touch()  # the trainers wait on the pool from now on: the job cannot end
        wait_until(lambda: len(train_worker_pids()) == config.train.workers,
                   what="the train workers")
        os.kill(train_worker_pids()[0], signal.SIGKILL)
        gate.unlink()
        thread.join(900)
        assert "error" not in outcome, outcome.get("error")
        assert outcome["summary"]["final_metrics"]["step"] == STEPS
        steps = [json.loads(line)["step"] for line in
                 (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
        assert steps == [*range(LOG_EVERY, STEPS + 1, LOG_EVERY), STEPS], "one record per step"
        resumed = [r.getMessage() for r in caplog.records if "resumed from its checkpoint" in
                   r.getMessage()]
        at = [s for s in range(CHECKPOINT_EVERY, STEPS, CHECKPOINT_EVERY)
              if len(resumed) == 1 and f"at step {s}" in resumed[0]]
        assert len(at) == 1, resumed
        assert mid_epoch(order, at[0] * config.train.workers), "killed mid-epoch"
        # Killed and resumed: what an uninterrupted run trains, each micro-batch once.
        trained_steps, trained = ledger(tmp_path / "run")
        assert trained_steps == list(range(1, STEPS + 1)), "one ledger line per step"
        assert trained == uninterrupted(order, STEPS * 2)
        assert trained != uninterrupted(expected_order(config, seed=1), STEPS * 2), "control"

        # Two workers' run resumed (mid-epoch) by a rerun with one worker: it goes on.
        assert mid_epoch(order, STEPS * 2)
        thread, outcome = start(load_yaml(JobConfig, ROOT / "examples" / "tiny.yaml", [
            *overrides, "train.workers=1", f"train.steps={STEPS + MORE_STEPS}"]))
        thread.join(900)
    assert "error" not in outcome, outcome.get("error")
    trained_steps, trained = ledger(tmp_path / "run")
    assert trained_steps == list(range(1, STEPS + MORE_STEPS + 1))
    assert trained == uninterrupted(order, STEPS * 2 + MORE_STEPS)
