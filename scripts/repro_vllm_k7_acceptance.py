"""Why vLLM's sampled acceptance at k = 7 came out below the exact expectation in every run.

The main job's summary compared vLLM's t = 1 acceptance with the exact expectation on the
simulation's own sampled answers, sampled with `eval.seed` (0 in every run), beside a range that
covers only the acceptance coin flips given those answers. This script takes a run folder
(`make run` writes runs/tiny) and shows, on the job's evaluation prompts:

1. `drafts`: vLLM (in-process, one prompt at a time, its rejection sampler spied on) drafts at
   every sampled verify step what eagle_ray's draft chain drafts on the HF target's states,
   at every position, and the target probabilities of those drafts equal HF's: vLLM 0.32's
   greedy drafting and standard rejection sampling are what the exact model assumes.
2. `vllm`: vLLM's acceptance length over `--batches` batches of the prompts (as the evaluation
   sends them), pooled, and per batch.
3. `simulation`: the exact expectation on the simulation's own answers for `--seeds` seeds:
   pooled, per seed, and seed 0's (the figure every run printed).
4. `paired`: the exact expectation on vLLM's own answers of part 2
   (`eagle_ray.evaluation.paired`), vLLM's length beside it and how many standard errors apart.

    python scripts/repro_vllm_k7_acceptance.py --run runs/tiny [--k 7] [--seeds 16]

Every result is one JSON line on stdout. Findings: docs/training.md, "vLLM at temperature 1".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
from pathlib import Path

import torch

MAX_NEW_TOKENS = 32  # eval.max_new_tokens of examples/tiny.yaml


def job_prompts(run: Path, tokenizer, count: int) -> list[list[int]]:
    """The job's evaluation prompts: its first held-out conversations, up to the last user turn."""
    from eagle_ray.data.chat import prompt_for_turn
    from eagle_ray.evaluation.prompts import EvalPrompt

    chats = next(run.glob("chats-*.jsonl"))
    prompts = []
    for line in chats.read_text().splitlines()[:count]:
        messages = EvalPrompt.from_conversation(json.loads(line)["messages"]).messages_for_turn(
            0, [])
        prompts.append(prompt_for_turn(tokenizer, messages, len(messages)))
    return prompts


def engine_results(queue, target: str, draft: str, k: int, prompts: list[list[int]],
                   stops: list[int], batches: int) -> None:
    """In a child process: every sampled verify step of each prompt answered alone (drafts,
    p(draft), accepted), then `batches` batches of all prompts (answers, counters). The engine's
    output goes to stderr: stdout carries the results alone."""
    os.dup2(2, 1)
    import vllm.v1.sample.rejection_sampler as rejection_sampler
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle_ray.backends.vllm.runner import CPU_DEFAULTS, build_llm

    steps: list[dict] = []
    sample = rejection_sampler.rejection_sample

    def spied(draft_ids, num_draft, max_len, cu, draft_probs, logits, *rest, **kwargs):
        out = sample(draft_ids, num_draft, max_len, cu, draft_probs, logits, *rest, **kwargs)
        probs, start = logits.float().softmax(-1), 0
        for n in num_draft:
            if n:
                drafted = draft_ids[start:start + n].tolist()
                steps.append({"drafts": drafted, "alphas": [
                    float(probs[start + j, t]) for j, t in enumerate(drafted)]})
            start += n
        return out

    rejection_sampler.rejection_sample = spied
    llm = build_llm({**CPU_DEFAULTS, "model": target, "dtype": "float32", "seed": 0,
                     "max_model_len": max(map(len, prompts)) + MAX_NEW_TOKENS + 17,
                     "speculative_config": {"method": "eagle3", "model": draft,
                                            "num_speculative_tokens": k},
                     "per_request_spec_decode_metrics": "summary"}, multiprocess=False)
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=1.0, stop_token_ids=stops,
                            detokenize=False)

    def answers(batch):
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params,
                               use_tqdm=False)
        return [(list(o.outputs[0].token_ids), o.outputs[0].spec_decode_metrics and
                 list(o.outputs[0].spec_decode_metrics.histogram)) for o in outputs]

    alone = []
    for prompt in prompts:
        before = len(steps)
        [(answer, _)] = answers([prompt])
        alone.append({"prompt": prompt, "answer": answer, "steps": steps[before:]})
    queue.put({"alone": alone, "batches": [answers(prompts) for _ in range(batches)]})


@torch.inference_mode()
def compare_drafts(target, draft, vocab, alone: list[dict]) -> dict:
    """Part 1: vLLM's drafts and p(draft) against the draft chain and HF's probabilities."""
    from eagle_ray.evaluation.paired import leading_matches
    from eagle_ray.evaluation.simulate import draft_chain, target_states

    head = target.get_target_head()
    steps = equal = 0
    positions: list[int] = []
    worst = 0.0
    for record in alone:
        prompt, answer, start = record["prompt"], record["answer"], 0
        for step in record["steps"]:
            seq = prompt + answer[:start]
            aux, _ = target_states(target, seq)
            ours = draft_chain(draft, vocab, aux, seq, answer[start], len(step["drafts"]))
            _, last = target_states(target, seq + [answer[start]] + step["drafts"])
            probs = torch.softmax(head(last[0, len(seq):]).float(), -1)
            worst = max(worst, max(abs(float(probs[j, t]) - a) for j, (t, a) in enumerate(
                zip(step["drafts"], step["alphas"], strict=True))))
            positions = positions or [0] * len(ours)
            for j, (a, b) in enumerate(zip(ours, step["drafts"], strict=True)):
                positions[j] += a == b
            steps, equal = steps + 1, equal + (ours == step["drafts"])
            start += leading_matches(step["drafts"], answer[start + 1:]) + 1
    return {"part": "drafts", "verify_steps": steps, "drafts_equal": equal,
            "equal_per_position": positions, "max_abs_alpha_difference": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="runs/tiny", help="a main job's output_dir")
    parser.add_argument("--k", type=int, default=7)
    parser.add_argument("--prompts", type=int, default=8, help="eval.prompts of the job")
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--batches", type=int, default=16)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from eagle_ray.backends.hf import HFEagle3TargetModel
    from eagle_ray.data.chat import stop_token_ids
    from eagle_ray.draft.export import exported_target, load_exported_draft
    from eagle_ray.evaluation.acceptance import AcceptanceTally, ServedAnswer
    from eagle_ray.evaluation.paired import replay_served
    from eagle_ray.evaluation.simulate import simulate_sampled
    from eagle_ray.train.report import paired_deviation

    run, k = Path(args.run), args.k
    identity = exported_target(run / "draft")
    tokenizer = AutoTokenizer.from_pretrained(identity.model_path)
    prompts, stops = job_prompts(run, tokenizer, args.prompts), stop_token_ids(tokenizer)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    child = context.Process(target=engine_results, args=(
        queue, identity.model_path, str(run / "draft"), k, prompts, list(stops), args.batches))
    child.start()
    engine = queue.get()
    child.join()
    target = HFEagle3TargetModel.from_pretrained(identity.model_path, dtype=torch.float32,
                                                 aux_layer_ids=identity.aux_layer_ids)
    draft, vocab = load_exported_draft(run / "draft",
                                       target.get_input_embeddings().weight.detach().float())
    draft.eval()
    print(json.dumps({"k": k, **compare_drafts(target, draft, vocab, engine["alone"])}),
          flush=True)
    served = [ServedAnswer(p, a, h) for batch in engine["batches"]
              for p, (a, h) in zip(prompts, batch, strict=True)]
    lengths = []
    for batch in engine["batches"]:
        tally = AcceptanceTally.empty(k)
        for _, histogram in batch:
            tally.add(histogram or [])
        lengths.append(round(tally.length(), 3))
    paired = replay_served(target, draft, vocab, served, k, 1.0)
    print(json.dumps({"part": "vllm", "k": k, "batches": len(lengths),
                      "pooled_length": paired.served.length(), "per_batch": lengths}),
          flush=True)
    runs = [simulate_sampled(target, draft, vocab, prompts, k, 1.0, MAX_NEW_TOKENS, stops, seed)
            for seed in range(args.seeds)]
    steps = sum(r.tally.steps for r in runs)
    print(json.dumps({"part": "simulation", "k": k, "seeds": len(runs),
                      "pooled_exact": 1 + sum(sum(r.expected) for r in runs) / steps,
                      "seed_0_exact": runs[0].expected_length(),
                      "per_seed_exact": [round(r.expected_length(), 3) for r in runs]}),
          flush=True)
    summary = paired.summary()
    print(json.dumps({"part": "paired", "k": k, "vllm": summary["vllm_length"],
                      "exact_on_vllm_answers": summary["expected"],
                      "standard_error": summary["standard_error"],
                      "z": paired_deviation({"mean_acceptance_length": summary["vllm_length"]},
                                            summary),
                      "answers": summary["answers"],
                      "answers_with_vllms_steps": summary["answers_with_vllms_steps"]}),
          flush=True)


if __name__ == "__main__":
    sys.exit(main())
