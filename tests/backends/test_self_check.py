"""The self-check's tolerance in bf16: a capture one layer off fails it, the right one passes.

The per-row rule (`refused_rows`) on constructed logits: near-ties within bf16 rounding are
accepted, clear disagreements refused. Then the HF model in bf16 as the engine (its own greedy
token from its own logits, as vLLM samples one), and a real vLLM engine in bf16 (slow), whose
kernels are not the head's: the right capture is never refused there, one layer off is caught.
`eagle-ray bench self-check` measures the same on 1,024 rows of a Llama-3.1-8B-shaped target.
"""

import pytest
import torch
from torch import nn

import eagle_ray.backends.self_check as self_check_module
from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.backends.self_check import (
    SelfCheckError,
    check_greedy_tokens,
    greedy_shortfall,
    refused_rows,
)
from eagle_ray.contract.target_head import TargetHead
from eagle_ray.testing import random_micro_batch
from eagle_ray.tiny import tiny_target

BF16_ULP_AT_10 = 2.0**-4  # bf16 keeps 8 significant bits: values in [8, 16) step by 1/16


def one_row(best: float, chosen: float, vocab: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """(engine token `[1]`, head logits `[1, vocab]`): the head's best logit `best` at token 7,
    the engine's token 3 at `chosen`, the rest far below."""
    logits = torch.linspace(-5.0, 0.0, vocab).view(1, -1)
    logits[0, 7], logits[0, 3] = best, chosen
    return torch.tensor([3]), logits


@pytest.mark.parametrize("ulps", [0, 1, 2, 4])
def test_a_near_tie_within_bf16_rounding_is_accepted(ulps):
    """Engine and head each round a logit by up to half an ulp: a tie can flip by 2 ulps; the
    rule allows 4 eps x |best| (5 ulps at 10)."""
    tokens, logits = one_row(10.0, 10.0 - ulps * BF16_ULP_AT_10)
    assert not refused_rows(tokens, logits, torch.bfloat16).any()


@pytest.mark.parametrize("ulps", [6, 16, 80])
def test_a_clear_disagreement_is_refused(ulps):
    """The control: past the tolerance (6 ulps at 10, 4 % of the best logit) it is refused."""
    tokens, logits = one_row(10.0, 10.0 - ulps * BF16_ULP_AT_10)
    assert refused_rows(tokens, logits, torch.bfloat16).all()
    assert greedy_shortfall(tokens, logits, torch.bfloat16).item() > 1


def test_the_tolerance_follows_the_head_dtype():
    tokens, logits = one_row(10.0, 10.0 - BF16_ULP_AT_10)  # 1 bf16 ulp: 62 fp32 tolerances
    assert refused_rows(tokens, logits, torch.float32).all()
    tokens, logits = one_row(10.0, 10.0 - 5e-4)  # within fp32's 1e-4 x |best|
    assert not refused_rows(tokens, logits, torch.float32).any()


def test_near_ties_from_bf16_rounding_alone_are_accepted():
    """An engine that norms its unrounded fp32 final state and rounds its logits to bf16, and
    the head over the captured (bf16-rounded) state: some greedy tokens flip, none is refused."""
    torch.manual_seed(0)
    hidden, vocab = 1024, 32_000
    head = TargetHead(nn.RMSNorm(hidden, eps=1e-5), nn.Linear(hidden, vocab, bias=False))
    nn.init.normal_(head.lm_head.weight, std=0.02)
    head = head.to(torch.bfloat16)
    final = torch.randn(512, hidden) * 3
    with torch.no_grad():
        normed = final * torch.rsqrt(final.pow(2).mean(-1, keepdim=True) + 1e-5)
        engine_logits = nn.functional.linear(normed.to(torch.bfloat16).float(),
                                             head.lm_head.weight.float()).to(torch.bfloat16)
        tokens = engine_logits.float().argmax(-1)
        logits = head(final.to(torch.bfloat16)).float()
    assert (logits.argmax(-1) != tokens).any(), "the control: the sample holds flipped near-ties"
    assert not refused_rows(tokens, logits, torch.bfloat16).any()
    check_greedy_tokens(tokens, final.to(torch.bfloat16), head)


@pytest.fixture(scope="module")
def bf16_capture():
    """(greedy tokens, the right final state, the state one layer earlier, head): the states
    at each row's last position (every row is 40 tokens long)."""
    target = HFEagle3TargetModel.from_pretrained(tiny_target("llama", pretrained=True),
                                                 dtype=torch.bfloat16)
    ids, attention_mask, _ = random_micro_batch(target.vocab_size, (40,) * 32, seed=1)
    with torch.no_grad():
        out = target.model(ids, output_hidden_states=True)
    right = target.runner.run(ids, attention_mask).last_hidden
    layers = target.num_hidden_layers
    # hidden_states[N] is after the final norm; [N - 1] is the input of the last layer: what
    # vLLM hands back for capture id N - 1, the canonical id passed untranslated.
    one_layer_off = out.hidden_states[layers - 1]
    return (out.logits[:, -1].argmax(-1), right[:, -1], one_layer_off[:, -1],
            target.get_target_head())


def test_the_right_capture_passes_in_bf16(bf16_capture):
    greedy, right, _, head = bf16_capture
    check_greedy_tokens(greedy, right, head)


def test_a_capture_one_layer_off_fails_in_bf16(bf16_capture):
    greedy, _, one_layer_off, head = bf16_capture
    with pytest.raises(SelfCheckError, match="layer-id convention"):
        check_greedy_tokens(greedy, one_layer_off, head)


def test_the_old_tolerance_of_half_the_best_logit_let_it_through(bf16_capture, monkeypatch):
    """The control: with 64 epsilons (half the best logit in bf16) the same mistake passes."""
    greedy, _, one_layer_off, head = bf16_capture
    monkeypatch.setattr(self_check_module, "SELF_CHECK_EPS", 64)
    check_greedy_tokens(greedy, one_layer_off, head)


@pytest.fixture(scope="module")
def vllm_bf16_capture(llama_path):
    """A real vLLM engine in bf16 (eager, the CPU default) on the tiny target, capturing each
    row's final state and the one a layer earlier (`eagle-ray bench self-check`'s engine):
    (greedy tokens, right states, one-layer-off states, head) over 512 random prompts."""
    from eagle_ray.bench.self_check import BATCH_ROWS, TwoStateEngine, random_prompts

    engine = TwoStateEngine(llama_path, torch.bfloat16)
    try:
        captures = [engine.capture(*random_prompts(engine.vocab_size, BATCH_ROWS, seed))
                    for seed in range(0, 512, BATCH_ROWS)]
    finally:
        engine.shutdown()
    tokens, right, off = (torch.cat(parts) for parts in zip(*captures, strict=True))
    return tokens, right, off, engine.head


@pytest.mark.slow
def test_the_real_engines_right_capture_is_never_refused(vllm_bf16_capture):
    tokens, right, _, head = vllm_bf16_capture
    with torch.no_grad():
        logits = head(right).float()
    assert (logits.argmax(-1) != tokens).any(), "the control: engine and head kernels differ"
    assert not refused_rows(tokens, logits, torch.bfloat16).any()
    check_greedy_tokens(tokens, right, head)


@pytest.mark.slow
def test_the_real_engines_capture_one_layer_off_is_caught(vllm_bf16_capture):
    tokens, _, off, head = vllm_bf16_capture
    with torch.no_grad():
        logits = head(off).float()
    disagreeing = int((logits.argmax(-1) != tokens).sum())  # the rows any rule could catch
    caught = int(refused_rows(tokens, logits, torch.bfloat16).sum())
    assert caught > disagreeing * 3 // 4, (caught, disagreeing)
    with pytest.raises(SelfCheckError, match="layer-id convention"):
        check_greedy_tokens(tokens, off, head)
