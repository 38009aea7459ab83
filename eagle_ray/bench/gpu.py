"""`eagle-ray bench gpu`: the GPU paths, measured on a GPU (needs torch and transformers only).

- `hf_vs_cpu`: the HF backend on the device against the same weights on the CPU, per encoding,
  in fp32 (max abs difference) and bf16 (cosine to the fp32 CPU reference), in the HF layout
  (states on the device) and vLLM's (states captured into host memory as rows, the head on
  the device: the base's waited copies between them);
- `supervision`: supervision tokens/s of the HF backend at a Llama-3.1-8B shape (random weights),
  returned on the device (co-located) and in host memory (a replica), side by side;
- `draft_step`: the draft's training step at the recipe's shape (2 x 4096 tokens, 7 TTT steps)
  with the linear-memory attention and the materialised one it replaced: tokens/s, peak memory,
  in bf16 autocast and fp32;
- `self_check`: the self-check's rule (`backends.self_check.refused_rows`) over 1,024 rows of a bf16
  model in vLLM's layout: the model's own greedy token (its full forward) against the head on
  the captured final state: correct captures refused (false alarms);
- `learner_step`: the training loop's own learner (`DraftLearner`, bf16 autocast) at the
  recipe's draft shape: tokens/s and peak memory against `eagle-ray plan`'s figure (ratio);
- `fp8`: quantising a batch's hidden states on the device then copying, against copying bf16;
- `pool` (when Ray is importable; otherwise a warning says it is skipped): a one-replica HF
  pool on the device against the same backend in this process, the same micro-batches (the
  pool's own overhead where cores are not shared). No other check imports Ray or vLLM: a lent
  GPU machine has neither.

`--device cpu --quick` runs the same code at tiny shapes in seconds (CI). Peak memory is
`torch.cuda.max_memory_allocated` on a GPU and `TensorMemoryProbe` on the CPU; every timing
synchronises the device (`bench.best_seconds`).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable

import torch

from eagle_ray.backends.base import RunnerEagle3TargetModel, RunnerOutput, TargetRunner
from eagle_ray.backends.hf import HFTargetRunner
from eagle_ray.bench import best_seconds, emit
from eagle_ray.contract.aux_layers import resolve_eagle3_aux_layer_ids
from eagle_ray.contract.fp8 import encode_batch
from eagle_ray.contract.target_batch import ENCODINGS
from eagle_ray.contract.target_head import TargetHead
from eagle_ray.draft.attention import reference_ttt_attention, ttt_attention
from eagle_ray.draft.model import (
    DraftConfig,
    Eagle3Draft,
    ttt_loss,
)
from eagle_ray.train.memory import TensorMemoryProbe

logger = logging.getLogger(__name__)

# (hidden, layers, heads, kv heads, intermediate, vocab, rows, seq, ttt steps)
SHAPES = {
    "llama3.1-8b": (4096, 32, 32, 8, 14336, 128256, 2, 4096, 7),
    "small": (128, 8, 2, 1, 256, 512, 2, 64, 3),
}


def run(device: str = "cuda", small: bool = False) -> None:
    """Every measurement of this module on `device`; `small`: tiny shapes (seconds)."""
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench gpu: no CUDA device here; run with --device cpu --quick")
    shape = SHAPES["small" if small else "llama3.1-8b"]
    hf_vs_cpu(device, shape)
    self_check(device, shape)
    supervision(device, shape)
    _free(device)  # the 8B target is gone by now
    for precision in ("bf16", "fp32"):
        draft_step(device, shape, precision)
    learner_step(device, shape)
    fp8(device, shape)
    pool_vs_in_process(device, small)


def _llama(shape, dtype: torch.dtype, device: torch.device, layers: int | None = None):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, num_layers, heads, kv_heads, intermediate, vocab, *_ = shape
    config = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers or num_layers,
                         num_attention_heads=heads, num_key_value_heads=kv_heads,
                         intermediate_size=intermediate, vocab_size=vocab,
                         max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(device):
        return LlamaForCausalLM(config).to(dtype).eval()


def _micro_batch(vocab: int, rows: int, seq: int) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(3, vocab, (rows, seq), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    return ids, mask, mask


def hf_vs_cpu(device: torch.device, shape) -> None:
    """The HF backend on `device` equals its CPU reference (fp32), and is close in bf16."""
    from eagle_ray.backends.hf import HFEagle3TargetModel
    from eagle_ray.contract.supervision import DraftVocab

    vocab = shape[5]
    micro_batch = _micro_batch(vocab, 2, 64)
    draft_vocab = DraftVocab(torch.arange(0, vocab, 4), vocab)
    reference_model = _llama(shape, torch.float32, torch.device("cpu"), layers=8)
    reference = HFEagle3TargetModel(reference_model, draft_vocab=draft_vocab)
    for dtype, layout in itertools.product((torch.float32, torch.bfloat16), ("hf", "vllm")):
        model = _llama(shape, torch.float32, device, layers=8)
        model.load_state_dict(reference_model.state_dict())
        backend = (HFEagle3TargetModel if layout == "hf" else host_rows_backend)(
            model.to(dtype), draft_vocab=draft_vocab)
        for encoding in ENCODINGS:
            want = reference.generate_batch(*micro_batch, encoding=encoding).tensors()
            got = backend.generate_batch(*micro_batch, encoding=encoding, device="cpu").tensors()
            for name, value in got.items():
                if not value.is_floating_point():
                    continue
                a, b = value.float().flatten(1), want[name].float().flatten(1)
                if dtype == torch.float32:
                    emit("gpu", "max_abs_diff_vs_cpu", float((a - b).abs().max()), "abs",
                         device=str(device), encoding=encoding, field=name, dtype="fp32",
                         layout=layout)
                else:
                    cosine = torch.nn.functional.cosine_similarity(a, b, dim=-1).min()
                    emit("gpu", "min_cosine_vs_cpu_fp32", round(float(cosine), 5), "cosine",
                         device=str(device), encoding=encoding, field=name, dtype="bf16",
                         layout=layout)


class HostRowsRunner(TargetRunner):
    """vLLM's layout from an HF model: the model runs on the device, each row's captured states
    come back into host memory unpadded (`[n, 4, H]`, as vLLM's capture hands them over) with
    the engine's own greedy next token (its full forward's logits), and the head stays on the
    device."""

    def __init__(self, model, aux_layer_ids: list[int]) -> None:
        self.model, self.capture = model, HFTargetRunner(model, aux_layer_ids)

    @torch.no_grad()
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> RunnerOutput:
        device = next(self.model.parameters()).device
        out = self.capture.run(input_ids, attention_mask)
        states = torch.cat([out.aux_hidden_states.unflatten(-1, (3, -1)),
                            out.last_hidden.unsqueeze(2)], dim=2)  # [B, S, 4, H]
        lengths = attention_mask.sum(dim=1)
        logits = self.model(input_ids=input_ids.to(device),
                            attention_mask=attention_mask.to(device)).logits
        last = (lengths - 1).to(device)
        next_ids = logits[torch.arange(len(last), device=device), last].argmax(-1).cpu()
        rows = [states[b, :n].cpu() for b, n in enumerate(lengths.tolist())]
        return RunnerOutput(rows=rows, next_token_ids=next_ids)


def host_rows_backend(model, draft_vocab=None, self_check: bool = False
                      ) -> RunnerEagle3TargetModel:
    """The base backend over `HostRowsRunner` (the vLLM layout on a GPU without vLLM)."""
    config = model.config
    aux_layer_ids = resolve_eagle3_aux_layer_ids(None, config.num_hidden_layers)
    return RunnerEagle3TargetModel(
        HostRowsRunner(model, aux_layer_ids), num_hidden_layers=config.num_hidden_layers,
        vocab_size=config.vocab_size, aux_layer_ids=aux_layer_ids,
        embedding=model.get_input_embeddings(), head=TargetHead.from_model(model),
        draft_vocab=draft_vocab, self_check=self_check)


def self_check(device: torch.device, shape, rows: int = 1024) -> None:
    """Correct captures the self-check refuses, in bf16 on `device` (fp32 on the CPU)."""
    from eagle_ray.backends.self_check import refused_rows

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = host_rows_backend(_llama(shape, dtype, device, layers=8))
    runner, head = backend.runner, backend.get_target_head()
    generator = torch.Generator().manual_seed(1)
    refused = 0
    for _ in range(rows // 16):
        lengths = torch.randint(2, 33, (16,), generator=generator)
        ids = torch.randint(3, shape[5], (16, int(lengths.max())), generator=generator)
        mask = (torch.arange(ids.shape[1]) < lengths[:, None]).long()
        out = runner.run(ids * mask, mask)
        final = torch.stack([r[-1, -1] for r in out.rows]).to(device)
        with torch.no_grad():
            logits = head(final).float()
        refused += int(refused_rows(out.next_token_ids.to(device), logits, dtype).sum())
    emit("gpu", "self_check_refused_right", refused, "rows", device=str(device),
         rows=rows // 16 * 16, dtype=str(dtype).removeprefix("torch."))
    del backend
    _free(device)


def supervision(device: torch.device, shape) -> None:
    """Supervision tokens/s at the shape, returned on the device and in host memory."""
    from eagle_ray.backends.hf import HFEagle3TargetModel

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    backend = HFEagle3TargetModel(_llama(shape, dtype, device))
    rows, seq = 8, min(shape[7], 2048)
    micro_batch = _micro_batch(shape[5], rows, seq)
    rates = {}
    for where in ("device", "cpu"):
        seconds = best_seconds(lambda w=where: backend.generate_batch(
            *micro_batch, device=None if w == "device" else "cpu"))
        rates[where] = rows * seq / seconds
    for where, rate in rates.items():
        emit("gpu", "supervision_tokens_per_s", round(rate, 1), "tok/s", device=str(device),
             returned_on=where, rows=rows, seq=seq, baseline="device",
             ratio=round(rate / rates["device"], 3))


def draft_step(device: torch.device, shape, precision: str) -> None:
    """Tokens/s and peak memory of one TTT training step, linear-memory vs materialised."""
    hidden, _, heads, kv_heads, intermediate, vocab, rows, seq, steps = shape
    config = DraftConfig(hidden_size=hidden, target_hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=hidden // heads,
                         intermediate_size=intermediate, vocab_size=vocab,
                         draft_vocab_size=min(32000, vocab))
    aux = torch.randn(rows, seq, 3 * hidden, device=device,
                      dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
    ids = torch.randint(0, vocab, (rows, seq), device=device)
    loss_mask = torch.ones_like(ids)
    probs = torch.softmax(torch.randn(rows, seq, config.draft_vocab_size, device=device), -1)
    position_mask = loss_mask.bool()
    results = {}
    for name, attention in (("linear", ttt_attention), ("materialised", reference_ttt_attention)):
        torch.manual_seed(0)
        with torch.device(device):
            draft = Eagle3Draft(config, attention=attention)

        def step(draft=draft) -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
                loss, _, _ = ttt_loss(draft, aux, ids, loss_mask, probs, position_mask, steps)
            loss.backward()
            draft.zero_grad(set_to_none=True)

        try:
            peak = _peak_bytes(device, step)
            results[name] = (rows * seq / best_seconds(step, 2), peak)
        except torch.OutOfMemoryError:
            logger.warning("draft step with %s attention ran out of memory", name)
        del draft
        _free(device)
    for name, (rate, peak) in results.items():
        emit("gpu", "draft_step_tokens_per_s", round(rate, 1), "tok/s", device=str(device),
             attention=name, precision=precision, rows=rows, seq=seq, ttt_steps=steps,
             baseline="materialised", ratio=round(rate / results["materialised"][0], 3)
             if "materialised" in results else None)
        emit("gpu", "draft_step_peak_gib", round(peak / 2**30, 3), "GiB", device=str(device),
             attention=name, precision=precision, rows=rows, seq=seq, ttt_steps=steps)


def learner_step(device: torch.device, shape) -> None:
    """The training loop's learner in bf16 autocast at the shape: tokens/s, and its peak memory
    (weights, AdamW state, one step) against the plan's for the same parts."""
    from eagle_ray.config import TrainConfig
    from eagle_ray.contract.supervision import DraftVocab
    from eagle_ray.contract.target_batch import Eagle3TargetBatch
    from eagle_ray.plan import trainer_memory
    from eagle_ray.train.loop import DraftLearner

    hidden, _, heads, kv_heads, intermediate, vocab, rows, seq, steps = shape
    config = DraftConfig(hidden_size=hidden, target_hidden_size=hidden, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, head_dim=hidden // heads,
                         intermediate_size=intermediate, vocab_size=vocab,
                         draft_vocab_size=min(32000, vocab))
    precision = "bf16" if device.type == "cuda" else "fp32"  # CPU: bf16 is slower there
    planned = trainer_memory(config, rows, seq, steps, torch.bfloat16, precision == "bf16",
                             ddp=False)
    _free(device)

    def measured() -> tuple[DraftLearner, Eagle3TargetBatch]:
        torch.manual_seed(0)
        head = TargetHead(torch.nn.RMSNorm(hidden), torch.nn.Linear(hidden, vocab, bias=False))
        learner = DraftLearner(Eagle3Draft(config), head.requires_grad_(False),
                               DraftVocab(torch.arange(config.draft_vocab_size), vocab),
                               TrainConfig(precision=precision, steps=10, ttt_steps=steps),
                               device)
        ids = torch.randint(0, vocab, (rows, seq), device=device)
        batch = Eagle3TargetBatch(
            aux_hidden_states=torch.randn(rows, seq, 3 * hidden, device=device).bfloat16(),
            input_ids=ids, attention_mask=torch.ones_like(ids), loss_mask=torch.ones_like(ids),
            last_hidden=torch.randn(rows, seq, hidden, device=device).bfloat16())
        learner.step(batch)  # AdamW's state exists from here
        return learner, batch

    peak = _peak_bytes(device, measured) if device.type == "cuda" else None
    learner, batch = measured()
    seconds = best_seconds(lambda: learner.step(batch), 2)
    emit("gpu", "learner_step_tokens_per_s", round(rows * seq / seconds, 1), "tok/s",
         device=str(device), precision=precision, rows=rows, seq=seq, ttt_steps=steps)
    if peak is not None:  # the CPU has no allocator statistics for weights made outside a probe
        plan = planned["weights"] + planned["optimizer"] + planned["step_peak"]
        emit("gpu", "learner_peak_gib", round(peak / 2**30, 3), "GiB", device=str(device),
             planned_gib=round(plan / 2**30, 3), ratio=round(peak / plan, 3), rows=rows,
             seq=seq, ttt_steps=steps)
    learner = batch = None  # freed before the next measurement
    _free(device)


def fp8(device: torch.device, shape) -> None:
    """Seconds to get a batch's hidden states into host memory: fp8 quantised on the device
    and copied, against the bf16 copy."""
    from eagle_ray.contract.target_batch import Eagle3TargetBatch

    hidden, rows, seq = shape[0], 8, min(shape[7], 2048)
    ids = torch.zeros(rows, seq, dtype=torch.long, device=device)
    batch = Eagle3TargetBatch(
        aux_hidden_states=torch.randn(rows, seq, 3 * hidden, device=device).bfloat16(),
        input_ids=ids, attention_mask=ids + 1, loss_mask=ids + 1,
        last_hidden=torch.randn(rows, seq, hidden, device=device).bfloat16())
    seconds = {kind: best_seconds(lambda k=kind: list(encode_batch(batch, k)))
               for kind in ("auto", "fp8")}
    for kind, value in seconds.items():
        emit("gpu", "to_host_seconds", round(value, 6), "s", device=str(device),
             encoding_dtype=kind, rows=rows, seq=seq, baseline="auto",
             ratio=round(value / seconds["auto"], 3))


def random_llama_backend(config):
    """Pool backend factory (`backend: "eagle_ray.bench.gpu:random_llama_backend"`): the HF
    backend on a random Llama built where the replica runs -- no checkpoint to write or read.
    `backend_kwargs`: `small` (tiny shape), `layers` (decoder layers kept)."""
    from eagle_ray.backends.hf import HFEagle3TargetModel

    options = config.backend_kwargs
    device = torch.device("cuda" if config.use_gpu else "cpu")
    dtype = torch.bfloat16 if config.use_gpu else torch.float32
    shape = SHAPES["small" if options.get("small") else "llama3.1-8b"]
    return HFEagle3TargetModel(_llama(shape, dtype, device, layers=options.get("layers")))


def pool_vs_in_process(device: torch.device, small: bool, rounds: int = 3) -> None:
    """Supervision tokens/s of a one-replica HF pool on `device` vs the same backend in this
    process returning host memory (what a replica returns), interleaved rounds."""
    try:
        import ray
    except ImportError as error:  # a bare GPU machine: torch and transformers only
        logger.warning("bench gpu: the pool comparison is skipped: Ray is not importable (%s)",
                       error)
        return

    from eagle_ray.bench import NAMESPACE
    from eagle_ray.pool import ClientConfig, PoolConfig, TargetPool

    gpu = device.type == "cuda"
    ray.init(num_cpus=4, num_gpus=1 if gpu else 0, object_store_memory=2 * 2**30,
             include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    layers = None if small else 8  # an 8B-wide target, shallower: two copies on one GPU
    config = PoolConfig(backend="eagle_ray.bench.gpu:random_llama_backend", use_gpu=gpu,
                        backend_kwargs={"small": small, "layers": layers},
                        cpus_per_bundle=1.0, name="bench-gpu", namespace=NAMESPACE)
    pool = TargetPool.create(config)
    try:
        in_process = random_llama_backend(config)
        rows, seq = 8, 64 if small else 2048
        batches = [_micro_batch(in_process.vocab_size, rows, seq) for _ in range(8)]
        client = pool.client(ClientConfig(max_inflight_micro_batches=4))
        rates: dict[str, list[float]] = {"in_process": [], "pool_1_replica": []}
        list(client.stream(batches[:2]))  # warm-up
        for b in batches[:2]:
            in_process.generate_batch(*b, device="cpu")
        for _ in range(rounds):
            rates["pool_1_replica"].append(
                rows * seq * len(batches) / best_seconds(lambda: list(client.stream(batches)), 1))
            rates["in_process"].append(rows * seq * len(batches) / best_seconds(
                lambda: [in_process.generate_batch(*b, device="cpu") for b in batches], 1))
        best = {path: max(values) for path, values in rates.items()}
        for path, rate in best.items():
            emit("gpu", "pool_supervision_tokens_per_s", round(rate, 1), "tok/s",
                 device=str(device), path=path, rows=rows, seq=seq, layers=layers,
                 baseline="in_process", ratio=round(rate / best["in_process"], 3))
    finally:
        pool.shutdown()
        ray.shutdown()


def _peak_bytes(device: torch.device, fn: Callable[[], None]) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before
    with TensorMemoryProbe() as probe:
        fn()
    return probe.peak


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
