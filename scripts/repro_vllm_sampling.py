"""Reproduce vLLM 0.32's CPU-build defect in sampled speculative decoding, and its fix.

The defect (eagle_ray/backends/vllm/cpu_sampling.py): the CPU stand-in for the rejection
sampler's `expand_kernel` writes a copy of the temperature buffer, so sampled verify steps
scale the target's logits by uninitialised memory. eagle_ray's vLLM plugin installs a fixed
kernel in every vLLM process; `EAGLE_RAY_CPU_SAMPLING_FIX=0` keeps vLLM's.

Part 1 (a second, no engine): one verify step of vLLM's rejection sampler over 20,000
requests at temperature 1, each drafting the target's argmax, with vLLM's kernel and with the
fix, seeded and unseeded: the acceptance rate against p(draft), and the total variation
between the emitted tokens and the target's softmax.

Part 2 (`--engine --draft DIR`, a few minutes): vLLM serving the target alone and with the
EAGLE-3 draft at temperature 1 (seeded, unseeded) and 0, with vLLM's kernel and with the fix:
the mean log-probability of the emitted tokens under the HF target, and the acceptance length
from vLLM's per-request counters.

    python scripts/repro_vllm_sampling.py
    python scripts/repro_vllm_sampling.py --engine --draft runs/tiny/draft

Every result is one JSON line on stdout. Findings: docs/training.md, "vLLM at temperature 1".
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys

import torch

SETTINGS = {"t1_seeded": {"temperature": 1.0, "seed": 0}, "t1_unseeded": {"temperature": 1.0},
            "t0": {"temperature": 0.0}}


def kernel_results(queue) -> None:
    """Part 1 in a fresh process (the check registers vLLM's kernel overrides there)."""
    from eagle_ray.backends.vllm.cpu_sampling import sampled_verify_check

    queue.put([{"part": "kernel", "fixed": fixed, "seeded": seeded,
                **sampled_verify_check(fixed, seeded)}
               for fixed in (False, True) for seeded in (False, True)])


class VerifySpy:
    """Wraps vLLM's rejection sampler (in-process engine) to record, per sampled verify step,
    p(first draft token) under the temperature-scaled target, whether it was accepted, and the
    uniforms the acceptance test drew: accepted share must equal mean p, uniforms average 0.5."""

    def __init__(self) -> None:
        import vllm.v1.sample.rejection_sampler as rejection_sampler

        self.first: list[tuple[float, bool]] = []
        self.uniforms: list[float] = []
        sample = rejection_sampler.rejection_sample
        uniform = rejection_sampler.generate_uniform_probs

        def spied_sample(draft_ids, num_draft, max_len, cu, draft_probs, logits, *rest, **kw):
            out = sample(draft_ids, num_draft, max_len, cu, draft_probs, logits, *rest, **kw)
            probs = logits.float().softmax(-1).gather(-1, draft_ids.long()[:, None])[:, 0]
            start = 0
            for row, n in enumerate(num_draft):
                if n:
                    accepted = int(out[row, 0]) == int(draft_ids[start])
                    self.first.append((float(probs[start]), accepted))
                start += n
            return out

        def spied_uniform(*args, **kwargs):
            values = uniform(*args, **kwargs)
            self.uniforms += values.tolist()
            return values

        rejection_sampler.rejection_sample = spied_sample
        rejection_sampler.generate_uniform_probs = spied_uniform

    def take(self) -> dict[str, float | None]:
        first, uniforms, self.first, self.uniforms = self.first, self.uniforms, [], []
        if not first:
            return {}
        return {"accept_rate_1": round(sum(a for _, a in first) / len(first), 3),
                "target_prob_1": round(sum(p for p, _ in first) / len(first), 3),
                "uniform_mean": round(sum(uniforms) / len(uniforms), 3) if uniforms else None}


def engine_results(queue, target: str, prompts: list[list[int]], spec: dict | None,
                   fixed: bool, max_tokens: int, stops: list[int]) -> None:
    """Per sampling setting: the answers, the acceptance length and `VerifySpy`'s figures (one
    in-process engine, in a child process of its own)."""
    import os

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle_ray.backends.vllm.cpu_sampling import SWITCH
    from eagle_ray.backends.vllm.runner import CPU_DEFAULTS, build_llm

    os.environ[SWITCH] = "1" if fixed else "0"  # read where the plugin loads: this process
    spy = VerifySpy()
    kwargs = {**CPU_DEFAULTS, "model": target, "dtype": "float32", "max_model_len": 512,
              "seed": 0}
    if spec is not None:
        kwargs.update(speculative_config=spec, per_request_spec_decode_metrics="summary")
    llm = build_llm(kwargs, multiprocess=False)
    results = {}
    for name, setting in SETTINGS.items():
        outputs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts],
                               SamplingParams(max_tokens=max_tokens, detokenize=False,
                                              stop_token_ids=stops, **setting), use_tqdm=False)
        steps = accepted = 0
        for output in outputs:
            metrics = output.outputs[0].spec_decode_metrics
            if metrics is not None:
                steps += sum(metrics.histogram)
                accepted += sum(j * c for j, c in enumerate(metrics.histogram))
        results[name] = {"answers": [list(o.outputs[0].token_ids) for o in outputs],
                         "acceptance_length": 1 + accepted / steps if steps else None,
                         **spy.take()}
    queue.put(results)


def mean_logprob(model, prompts: list[list[int]], answers: list[list[int]]) -> float:
    """Mean log-probability (temperature 1) of the answers' tokens under the HF target."""
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, answer in zip(prompts, answers, strict=True):
            if answer:
                logits = model(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1:-1]
                total += float(logits.float().log_softmax(-1)
                               .gather(-1, torch.tensor(answer)[:, None]).sum())
                count += len(answer)
    return total / max(count, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine", action="store_true", help="also run the vLLM engines")
    parser.add_argument("--target", help="target folder (default: the kit's tiny target)")
    parser.add_argument("--draft", help="an EAGLE-3 draft folder (eagle-ray's export)")
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    process = context.Process(target=kernel_results, args=(queue,))
    process.start()
    for result in queue.get():
        print(json.dumps(result), flush=True)
    process.join()
    if not args.engine:
        return
    if not args.draft:
        parser.error("--engine needs --draft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eagle_ray.data.chat import prompt_for_turn, stop_token_ids
    from eagle_ray.tiny import generate_chat_samples, tiny_target

    target = args.target or str(tiny_target("llama", pretrained=True))
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = [prompt_for_turn(tokenizer, s["messages"], len(s["messages"]) - 1)
               for s in generate_chat_samples(args.prompts, seed=3)]
    stops = list(stop_token_ids(tokenizer))  # answers end where the evaluation ends them
    spec = {"method": "eagle3", "model": args.draft, "num_speculative_tokens": args.k}
    runs = {"target_alone": (None, True), "eagle3_vllm_kernel": (spec, False),
            "eagle3_fixed": (spec, True)}
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for run, (run_spec, fixed) in runs.items():
        child = context.Process(target=engine_results, args=(
            queue, target, prompts, run_spec, fixed, args.max_tokens, stops))
        child.start()
        results = queue.get()
        child.join()
        for name, result in results.items():
            answers = result.pop("answers")
            print(json.dumps({"part": "engine", "run": run, "setting": name, **result,
                              "mean_logprob": round(mean_logprob(model, prompts, answers), 3)}),
                  flush=True)


if __name__ == "__main__":
    sys.exit(main())
