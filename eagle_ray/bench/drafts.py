"""EAGLE-3 against P-EAGLE and DFlash on the same data, in one run: what each accepts and what
each costs.

The drafts train in this process through the training loop's own learner (`DraftLearner`) from
the same seed, on the same chats' supervision (the pre-trained kit target over the kit's chats:
EAGLE-3's three aux layers for EAGLE-3 and P-EAGLE, five for DFlash, as examples/tiny-dflash.yaml
captures), for the same steps, each shaped as its tiny example (DFlash: three layers). Then, on
the same held-out prompts: the greedy simulation's acceptance at each k (the HF target), and
vLLM serving each exported draft at each k as the job would (`DraftServing`): its acceptance,
whether greedy output stayed unchanged, output tokens per second of wall time (best of the
rounds, the drafts interleaved), the draft forwards per verify step counted in vLLM's engine
(`eagle_ray.backends.vllm.draft_forwards`; k for EAGLE-3's chain, one for parallel drafting,
P-EAGLE and DFlash's block, which is what those trade acceptance for) -- and the draft's own
time per verify step (the simulation's proposal, median of 5 per prompt). Ratios are against
EAGLE-3. On the CPU build the tiny draft costs about as much as the tiny target, so the
tokens/s ratio shows the mechanism, not a GPU's gain.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

import torch

from eagle_ray.bench import emit

KINDS = ("eagle3", "peagle", "dflash")
# As examples/tiny-<kind>.yaml trains each kind: its captured layers (None: EAGLE-3's default)
# and draft layers (1 unless named).
AUX_LAYER_IDS = {"dflash": [1, 2, 3, 4, 5]}
NUM_LAYERS = {"dflash": 3}


def run(model_path: str, steps: int = 150, ks: tuple[int, ...] = (3, 7), prompts: int = 16,
        max_new_tokens: int = 32, rounds: int = 2, samples: int = 320,
        kinds: tuple[str, ...] = KINDS) -> None:
    """`kinds`: EAGLE-3 (the baseline) and the others compared with it."""
    from eagle_ray.backends.hf import HFEagle3TargetModel
    from eagle_ray.contract.identity import TargetIdentity
    from eagle_ray.data.chat import prompt_for_turn, stop_token_ids
    from eagle_ray.data.tokenizer_files import load_tokenizer
    from eagle_ray.evaluation.evaluate import greedy_generate
    from eagle_ray.evaluation.simulate import draft_seconds_per_verify_step
    from eagle_ray.tiny import generate_chat_samples

    _, tokenizer = load_tokenizer(model_path, {}, "the benchmark")
    targets = {kind: HFEagle3TargetModel.from_pretrained(
        model_path, aux_layer_ids=AUX_LAYER_IDS.get(kind), dtype=torch.float32) for kind in kinds}
    stops = stop_token_ids(tokenizer)
    held_out = [prompt_for_turn(tokenizer, s["messages"], 2)
                for s in generate_chat_samples(prompts, seed=77)]
    answers = [greedy_generate(targets["eagle3"], p, max_new_tokens, stops) for p in held_out]
    exports, simulated, draft_seconds = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind, target in targets.items():
            supervision, vocab = _supervision(target, tokenizer, samples)
            draft, folder = _train_and_export(
                kind, target, tokenizer, vocab, supervision, steps, max(ks),
                TargetIdentity.of_backend(target, model_path), Path(tmp) / kind)
            exports[kind] = folder
            simulated[kind] = _simulate(target, draft, vocab, held_out, answers, ks)
            draft_seconds[kind] = draft_seconds_per_verify_step(target, draft, vocab, held_out,
                                                                ks, repeats=5)
        served_rates, served_forwards = _serve(model_path, exports, held_out, ks, max_new_tokens,
                                               stops, answers, rounds)
    for k in ks:
        for kind in kinds:
            common = {"kind": kind, "k": k, "steps": steps, "baseline": "eagle3"}
            emit("drafts", "simulated_acceptance_length", round(simulated[kind][k], 3), "tokens",
                 ratio=round(simulated[kind][k] / simulated["eagle3"][k], 3), **common)
            length, equal, rate = served_rates[kind][k]
            base = served_rates["eagle3"][k]
            emit("drafts", "vllm_acceptance_length", round(length, 3), "tokens",
                 ratio=round(length / base[0], 3), greedy_unchanged=equal, **common)
            emit("drafts", "vllm_output_tokens_per_s", round(rate, 1), "tok/s",
                 ratio=round(rate / base[2], 3), **common)
            forwards, base_forwards = served_forwards[kind][k], served_forwards["eagle3"][k]
            if forwards is not None and base_forwards:
                emit("drafts", "draft_forwards_per_verify_step", round(forwards, 3), "forwards",
                     ratio=round(forwards / base_forwards, 3), **common)
            seconds = draft_seconds[kind][k]
            emit("drafts", "draft_seconds_per_verify_step", seconds, "s",
                 ratio=round(seconds / draft_seconds["eagle3"][k], 3), **common)


def _supervision(target, tokenizer, samples: int):
    """The kit's chats as the target's supervision (fp32), and their draft vocabulary."""
    from eagle_ray.contract.supervision import DraftVocab
    from eagle_ray.data.draft_vocab import answer_token_counts
    from eagle_ray.data.micro_batches import make_micro_batches
    from eagle_ray.data.tokenize import tokenize_chats
    from eagle_ray.tiny import generate_chat_samples

    chats = [(f"sample {i}", s["messages"])
             for i, s in enumerate(generate_chat_samples(samples, seed=5))]
    rows = tokenize_chats(chats, tokenizer, 256, target.vocab_size).rows
    vocab = DraftVocab.from_token_counts(answer_token_counts(rows, target.vocab_size),
                                         min(256, target.vocab_size))
    return [target.generate_batch(*mb) for mb in make_micro_batches(rows, 8)], vocab


def _train_and_export(kind: str, target, tokenizer, vocab, supervision, steps: int, depth: int,
                      served, out: Path):
    """(the trained draft of `kind`, its export folder): `steps` learner steps over the
    supervision, epoch after epoch, from seed 0."""
    from eagle_ray.config import TrainConfig
    from eagle_ray.draft.export import export_draft
    from eagle_ray.draft.kinds import build_draft
    from eagle_ray.draft.model import DraftConfig
    from eagle_ray.draft.peagle import resolve_mask_token_id
    from eagle_ray.train.loop import DraftLearner

    torch.manual_seed(0)
    config = DraftConfig.from_target(target.model.config, vocab.size,
                                     num_layers=NUM_LAYERS.get(kind, 1),
                                     num_aux_layers=len(target.aux_layer_ids))
    embedding = target.get_input_embeddings().weight.detach()
    draft = build_draft(kind, config, embedding,
                        resolve_mask_token_id(None, tokenizer, target.vocab_size))
    train = TrainConfig(steps=steps, warmup_steps=max(steps // 10, 1), lr=3e-3, grad_clip=1.0,
                        ttt_steps=depth, precision="fp32")
    learner = DraftLearner(draft, target.get_target_head(), vocab, train, torch.device("cpu"))
    for step in range(steps):
        learner.step(supervision[step % len(supervision)])
    return draft.eval(), export_draft(draft, vocab, served, out, ttt_steps=depth)


def _simulate(target, draft, vocab, prompts, answers, ks) -> dict[int, float]:
    from eagle_ray.evaluation.simulate import simulate_acceptance

    return {k: simulate_acceptance(target, draft, vocab, prompts, answers, k)[0] for k in ks}


def _serve(model_path: str, exports: dict[str, Path], prompts, ks, max_new_tokens: int, stops,
           answers, rounds: int) -> tuple[dict[str, dict[int, tuple[float, bool, float]]],
                                          dict[str, dict[int, float | None]]]:
    """Per kind and k: (vLLM's acceptance length, greedy output unchanged, output tokens/s),
    and the draft forwards per verify step its engine ran (None: not counted, logged)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle_ray.backends.vllm import draft_forwards
    from eagle_ray.backends.vllm.runner import CPU_DEFAULTS, build_llm
    from eagle_ray.draft.serving import DraftServing
    from eagle_ray.evaluation.acceptance import AcceptanceTally

    params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0,
                            stop_token_ids=list(stops), detokenize=False)
    requests = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
    results: dict[str, dict[int, tuple[float, bool, float]]] = {kind: {} for kind in exports}
    forwards: dict[str, dict[int, float | None]] = {kind: {} for kind in exports}
    for k in ks:
        engines = {kind: build_llm({**CPU_DEFAULTS, **DraftServing.for_target(
            model_path, folder, "float32").engine_kwargs(k), "max_model_len": 512,
            "per_request_spec_decode_metrics": "summary",
            "worker_extension_cls": draft_forwards.EXTENSION}, multiprocess=True)
            for kind, folder in exports.items()}
        try:
            counting = {kind: draft_forwards.start_counting(llm) for kind, llm in engines.items()}
            best, last = {kind: 0.0 for kind in exports}, {}
            for _ in range(rounds):  # interleaved: drift on a shared machine hits both
                for kind, llm in engines.items():
                    start = time.perf_counter()
                    last[kind] = llm.generate(requests, params, use_tqdm=False)
                    elapsed = time.perf_counter() - start
                    tokens = sum(len(o.outputs[0].token_ids) for o in last[kind])
                    best[kind] = max(best[kind], tokens / elapsed)
            for kind, outputs in last.items():
                tally = AcceptanceTally.empty(k)
                for output in outputs:
                    if output.outputs[0].spec_decode_metrics is not None:
                        tally.add(output.outputs[0].spec_decode_metrics.histogram)
                unchanged = [list(o.outputs[0].token_ids) for o in outputs] == answers
                results[kind][k] = (tally.length(), unchanged, best[kind])
                counts = draft_forwards.read(engines[kind]) if counting[kind] else None
                forwards[kind][k] = counts.per_verify_step() if counts else None
        finally:
            for llm in engines.values():
                llm.llm_engine.engine_core.shutdown()
    return results, forwards

