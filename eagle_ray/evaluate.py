"""Acceptance length of a draft against its target, measured two independent ways.

1. `simulate_acceptance`: the project's own greedy chain drafting. Per iteration the target gives
   its next token, the draft proposes k more, the target's greedy continuation accepts a prefix;
   acceptance length = tokens gained per target forward.
2. `vllm_acceptance`: vLLM itself serving the exported draft as the target's `eagle3` speculative
   model, read from vLLM's spec-decode counters (1 + accepted / drafts). Greedy output with
   speculation is also compared with the target's greedy output without it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from eagle_ray.chat import prompt_for_turn, stop_token_ids
from eagle_ray.config import EvalConfig
from eagle_ray.console import native_output_to_log
from eagle_ray.draft.export import load_exported_draft
from eagle_ray.draft.model import Eagle3Draft, shift_left
from eagle_ray.hf_target import HFEagle3TargetModel
from eagle_ray.supervision import DraftVocab
from eagle_ray.target_runner import Sampling

logger = logging.getLogger(__name__)


def prompt_ids(conversations: Sequence[list[dict[str, str]]], tokenizer) -> list[list[int]]:
    """Each held-out conversation up to its last assistant turn, with the generation prompt:
    what the target answers at serving time."""
    prompts = []
    for messages in conversations:
        last_answer = max((i for i, m in enumerate(messages) if m["role"] == "assistant"),
                          default=len(messages))
        prompts.append(prompt_for_turn(tokenizer, messages, last_answer))
    return prompts


def greedy_generate(target: HFEagle3TargetModel, prompt: list[int], max_new_tokens: int,
                    stop_token_ids: tuple[int, ...] = ()) -> list[int]:
    """The target's greedy continuation of `prompt`, up to and including a stop token."""
    return target.complete([prompt], Sampling(max_new_tokens=max_new_tokens,
                                              stop_token_ids=stop_token_ids))[0]


@torch.inference_mode()
def simulate_acceptance(target: HFEagle3TargetModel, draft: Eagle3Draft, vocab: DraftVocab,
                        prompts: list[list[int]], k: int, max_new_tokens: int,
                        stop_token_ids: tuple[int, ...] = ()) -> tuple[float, list[float]]:
    """Mean acceptance length of greedy chain drafting of `k` tokens (tokens gained per target
    forward), over each answer up to its end-of-turn token (as vLLM stops there), and per draft
    position the share of drafts accepted up to it."""
    head = target.get_target_head()
    drafts, accepted_total, per_position = 0, 0, [0] * k
    for prompt in prompts:
        continuation = greedy_generate(target, prompt, max_new_tokens, stop_token_ids)
        seq, produced = list(prompt), 0
        while produced < len(continuation):
            ids = torch.tensor([seq])
            ones = torch.ones_like(ids)
            out = target.runner.run(ids, ones)
            next_token = int(head(out.last_hidden[0, -1]).argmax())
            truth = continuation[produced + 1: produced + 1 + k]
            if not truth:  # the answer ends with this token: no draft left to verify
                break
            # Step j reads, at the last slot, the token drafted by step j - 1.
            step_ids = [torch.tensor([seq[1:] + [next_token]])]
            drafted: list[int] = []
            for _ in range(k):
                logits = draft(out.aux_hidden_states.float(), step_ids)[-1][0, -1]
                drafted.append(int(vocab.draft_to_target[int(logits.argmax())]))
                step = shift_left(step_ids[-1], 1)
                step[0, -1] = drafted[-1]
                step_ids.append(step)
            accepted = 0
            while accepted < len(truth) and drafted[accepted] == truth[accepted]:
                accepted += 1
            seq += [next_token] + drafted[:accepted]
            produced += 1 + accepted
            drafts += 1
            accepted_total += accepted
            for position in range(accepted):
                per_position[position] += 1
    # vLLM's definition, so the two measurements are comparable: 1 + accepted / drafts.
    return (1 + accepted_total / max(drafts, 1),
            [count / max(drafts, 1) for count in per_position])


def vllm_acceptance(model_path: str, draft_dir: str | Path, prompts: list[list[int]], k: int,
                    max_new_tokens: int, reference: list[list[int]] | None = None,
                    dtype: str = "float32", stop_token_ids: tuple[int, ...] = ()
                    ) -> dict[str, Any]:
    """Serve the exported draft with vLLM (`method="eagle3"`) and read its acceptance counters;
    generation stops at `stop_token_ids` (the chat's end of turn)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.platforms import current_platform

    from eagle_ray.vllm_runner import CPU_DEFAULTS, GPU_DEFAULTS, build_llm

    defaults = CPU_DEFAULTS if current_platform.is_cpu() else GPU_DEFAULTS
    with native_output_to_log():
        # Sized for these prompts, not the checkpoint's max_position_embeddings (131,072 for a
        # Llama-3.1 would not fit the CPU's KV budget): docs in eagle_ray.engine_sizing.
        llm = build_llm({**defaults, "model": model_path, "dtype": dtype,
                         "max_model_len": max(map(len, prompts)) + max_new_tokens + 1,
                         "disable_log_stats": False,
                         "speculative_config": speculative_config(draft_dir, k)},
                        multiprocess=True)
        try:
            params = SamplingParams(max_tokens=max_new_tokens, temperature=0.0, ignore_eos=True,
                                    stop_token_ids=list(stop_token_ids), detokenize=False)
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                                   use_tqdm=False)
            metrics = llm.get_metrics()
        finally:
            llm.llm_engine.engine_core.shutdown()
    counters = {m.name: m.value for m in metrics if hasattr(m, "value")}
    vectors = {m.name: m.values for m in metrics if hasattr(m, "values")}
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    per_position = vectors.get("vllm:spec_decode_num_accepted_tokens_per_pos", [0] * k)
    result: dict[str, Any] = {
        "mean_acceptance_length": 1 + accepted / drafts if drafts else float("nan"),
        "drafts": drafts, "accepted_tokens": accepted,
        "acceptance_per_position": [a / drafts if drafts else float("nan")
                                    for a in per_position],
    }
    if reference is not None:
        generated = [list(o.outputs[0].token_ids) for o in outputs]
        result["greedy_equal_fraction"] = sum(
            g == r[:len(g)] for g, r in zip(generated, reference, strict=True)) / len(generated)
    return result


def _figure(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.2f}"


def speculative_config(draft_dir: str | Path, k: int) -> dict[str, Any]:
    """vLLM's `speculative_config` for serving `draft_dir` as the target's EAGLE-3 draft (the
    evaluation and the printed `vllm serve` command use the same)."""
    return {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": k}


def evaluate_draft(model_path: str, draft_dir: str | Path,
                   held_out: Sequence[list[dict[str, str]]], tokenizer, eval_config: EvalConfig,
                   ) -> dict[str, Any]:
    """Acceptance of the trained draft both ways (see module doc) and of an untrained one
    simulated, on the target the draft was exported for (its aux layer ids), loaded from
    `model_path`."""
    from eagle_ray.draft.export import exported_target

    served = exported_target(draft_dir)
    target = HFEagle3TargetModel.from_pretrained(model_path, list(served.aux_layer_ids),
                                                 dtype=torch.float32)
    prompts = prompt_ids(held_out[:eval_config.prompts], tokenizer)
    if not prompts:
        raise ValueError("evaluation needs held-out prompts (data.eval_samples > 0)")
    embedding = target.get_input_embeddings().weight.detach()
    trained, vocab = load_exported_draft(draft_dir, embedding)
    torch.manual_seed(1234)
    untrained = Eagle3Draft(trained.config, embedding)
    k, n = eval_config.num_speculative_tokens, eval_config.max_new_tokens
    stops = stop_token_ids(tokenizer)  # answers end at the chat's end-of-turn token
    report: dict[str, Any] = {"num_speculative_tokens": k, "prompts": len(prompts)}
    for name, draft in (("trained", trained), ("untrained", untrained)):
        draft.eval()
        mean, per_position = simulate_acceptance(target, draft, vocab, prompts, k, n, stops)
        report[f"simulated_acceptance_{name}"] = mean
        report[f"simulated_acceptance_per_position_{name}"] = per_position
    if eval_config.vllm:
        reference = [greedy_generate(target, p, n, stops) for p in prompts]
        # The trained draft only: the untrained baseline is the simulation's (it agrees with
        # vLLM's counters exactly), and a second spec-decoding engine would double the time.
        result = vllm_acceptance(model_path, draft_dir, prompts, k, n, reference,
                                 stop_token_ids=stops)
        report["vllm_acceptance_trained"] = result["mean_acceptance_length"]
        report["vllm_acceptance_per_position_trained"] = result["acceptance_per_position"]
        report["vllm_greedy_equal_fraction_trained"] = result["greedy_equal_fraction"]
    logger.info("evaluation: acceptance length at k=%d, trained %.2f (vLLM %s), untrained %.2f",
                k, report["simulated_acceptance_trained"],
                _figure(report.get("vllm_acceptance_trained")),
                report["simulated_acceptance_untrained"])
    return report
