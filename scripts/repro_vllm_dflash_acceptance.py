"""vLLM 0.32's CPU build against eagle_ray's simulation on a three-layer DFlash draft, per prompt.

`eagle-ray bench drafts` trains a three-layer DFlash draft on the kit's five target layers. As
shipped, vLLM's CPU build norms every draft layer's context keys with layer 0's `k_norm`
(eagle_ray/backends/vllm/cpu_dflash.py), so it accepts a different count than the greedy
simulation of the same draft on a few prompts. This script trains that draft (the bench's own
code, same seed), then prints per held-out prompt the simulation's acceptance length and vLLM's,
one prompt at a time and batched:

    python scripts/repro_vllm_dflash_acceptance.py            # with eagle_ray's fix: equal
    python scripts/repro_vllm_dflash_acceptance.py --shipped  # vLLM's code as shipped

Every result is one JSON line on stdout. Findings: docs/training.md, "Draft kinds".
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from eagle_ray.backends.vllm import cpu_dflash


def acceptance(outputs, k: int) -> float:
    from eagle_ray.evaluation.acceptance import AcceptanceTally

    tally = AcceptanceTally.empty(k)
    for output in outputs:
        if output.outputs[0].spec_decode_metrics is not None:
            tally.add(output.outputs[0].spec_decode_metrics.histogram)
    return tally.length()


def main(k: int = 3) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from eagle_ray.backends.hf import HFEagle3TargetModel
    from eagle_ray.backends.vllm.runner import CPU_DEFAULTS, build_llm
    from eagle_ray.bench import drafts
    from eagle_ray.contract.identity import TargetIdentity
    from eagle_ray.data.chat import prompt_for_turn, stop_token_ids
    from eagle_ray.data.tokenizer_files import load_tokenizer
    from eagle_ray.draft.serving import DraftServing
    from eagle_ray.evaluation.evaluate import greedy_generate
    from eagle_ray.evaluation.simulate import simulate_acceptance
    from eagle_ray.tiny import generate_chat_samples, tiny_target

    path = str(tiny_target("llama", pretrained=True))
    _, tokenizer = load_tokenizer(path, {}, "the reproduction")
    stops = stop_token_ids(tokenizer)
    prompts = [prompt_for_turn(tokenizer, s["messages"], 2)
               for s in generate_chat_samples(16, seed=77)]
    target = HFEagle3TargetModel.from_pretrained(
        path, aux_layer_ids=drafts.AUX_LAYER_IDS["dflash"], dtype=torch.float32)
    answers = [greedy_generate(target, p, 32, stops) for p in prompts]
    supervision, vocab = drafts._supervision(target, tokenizer, 320)
    with tempfile.TemporaryDirectory() as tmp:
        draft, folder = drafts._train_and_export(
            "dflash", target, tokenizer, vocab, supervision, 150, 7,
            TargetIdentity.of_backend(target, path), Path(tmp) / "dflash")
        simulated = [simulate_acceptance(target, draft, vocab, [p], [a], k)[0]
                     for p, a in zip(prompts, answers, strict=True)]
        print(json.dumps({"measure": "simulation", "k": k, "per_prompt": simulated,
                          "all": simulate_acceptance(target, draft, vocab, prompts, answers,
                                                     k)[0]}), flush=True)
        params = SamplingParams(max_tokens=32, temperature=0.0, stop_token_ids=list(stops),
                                detokenize=False)
        requests = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        kwargs = DraftServing.for_target(path, folder, "float32").engine_kwargs(k)
        llm = build_llm({**CPU_DEFAULTS, **kwargs, "max_model_len": 512,
                         "per_request_spec_decode_metrics": "summary"}, multiprocess=True)
        try:
            batched = llm.generate(requests, params, use_tqdm=False)
            single = [llm.generate([r], params, use_tqdm=False)[0] for r in requests]
            print(json.dumps({
                "measure": "vllm", "fix": os.environ.get(cpu_dflash.SWITCH, "1") != "0",
                "k": k, "batched": acceptance(batched, k),
                "all_one_at_a_time": acceptance(single, k),
                "per_prompt": [acceptance([o], k) for o in single],
                "greedy_unchanged": [list(o.outputs[0].token_ids) for o in batched] == answers}),
                flush=True)
        finally:
            llm.llm_engine.engine_core.shutdown()


if __name__ == "__main__":
    if "--shipped" in sys.argv:  # before any vLLM process loads eagle_ray's plugin
        os.environ[cpu_dflash.SWITCH] = "0"
    main()
