"""Supervision throughput of target backends on the tiny target, side by side in one run."""

from __future__ import annotations

import logging

from eagle_ray.backends.base import RunnerEagle3TargetModel
from eagle_ray.bench import best_seconds, emit
from eagle_ray.contract.target_batch import ENCODINGS
from eagle_ray.testing import random_micro_batch

logger = logging.getLogger(__name__)

BATCH_SHAPES = [(4, 128), (16, 128), (8, 384)]


def tokens_per_second(backend: RunnerEagle3TargetModel, batch: int, seq: int,
                      repeats: int = 3) -> float:
    ids, attention, loss = random_micro_batch(backend.vocab_size, (seq,) * batch)
    seconds = best_seconds(lambda: backend.generate_batch(ids, attention, loss), repeats)
    return batch * seq / seconds


def run_backends(backends: dict[str, RunnerEagle3TargetModel], baseline: str,
                 shapes: list[tuple[int, int]] = BATCH_SHAPES) -> None:
    """Tokens/s of each backend per batch shape, with its ratio to `baseline`."""
    for batch, seq in shapes:
        rates = {name: tokens_per_second(b, batch, seq) for name, b in backends.items()}
        for name, rate in rates.items():
            emit("backends", "supervision_tokens_per_s", round(rate, 1), "tok/s", backend=name,
                 batch=batch, seq=seq, baseline=baseline, ratio=round(rate / rates[baseline], 3))


def run_measured_bytes(backend: RunnerEagle3TargetModel) -> None:
    """Bytes per token of each encoding as actually returned by `backend` (needs a draft vocab)."""
    ids, attention, loss = random_micro_batch(backend.vocab_size, (64, 64))
    sizes = {e: backend.generate_batch(ids, attention, loss, encoding=e).nbytes / ids.numel()
             for e in ENCODINGS}
    for encoding, size in sizes.items():
        emit("encodings", f"bytes_per_token.{encoding}", size, "B/token", model="tiny",
             baseline="logits", ratio=round(size / sizes["logits"], 4))


def run_engine_start(model_path: str) -> None:
    """vLLM engine start time, engine core in this process vs in its own process."""
    from eagle_ray.backends.vllm.target import VLLMEagle3TargetModel

    seconds = {}
    for mode, multiprocess in (("inprocess", False), ("multiprocess", True)):
        target = VLLMEagle3TargetModel.from_pretrained(model_path, dtype="float32",
                                                       multiprocess=multiprocess)
        seconds[mode] = target.runner.start_seconds
        target.shutdown()
    for mode, value in seconds.items():
        emit("engine_start", "seconds", round(value, 2), "s", engine_core=mode,
             baseline="inprocess", ratio=round(value / seconds["inprocess"], 3))


def run(model_path: str) -> None:
    """HF vs vLLM (in-process engine) on the tiny fp32 target, and the bytes of each encoding."""
    import torch

    from eagle_ray.backends.hf import HFEagle3TargetModel
    from eagle_ray.backends.vllm.target import VLLMEagle3TargetModel
    from eagle_ray.contract.supervision import DraftVocab

    hf = HFEagle3TargetModel.from_pretrained(model_path, dtype=torch.float32)
    half_vocab = DraftVocab.from_token_counts(torch.ones(hf.vocab_size), hf.vocab_size // 2)
    hf = HFEagle3TargetModel(hf.model, hf.aux_layer_ids, draft_vocab=half_vocab)
    run_measured_bytes(hf)
    vllm = VLLMEagle3TargetModel.from_pretrained(model_path, dtype="float32")
    run_backends({"hf": hf, "vllm": vllm}, baseline="hf")
    vllm.shutdown()
