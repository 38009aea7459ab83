"""The self-check's tolerance in bf16: a capture one layer off fails it, the right one passes.

The engine here is the HF model in bf16 (its own greedy token from its own logits, as vLLM
samples one); the check is what is tested, not the engine.
"""

import pytest
import torch

import eagle_ray.backends.base as target_runner
from eagle_ray.backends.base import SelfCheckError, check_greedy_tokens
from eagle_ray.backends.hf import HFEagle3TargetModel
from eagle_ray.testing import random_micro_batch
from eagle_ray.tiny import tiny_target


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
    monkeypatch.setattr(target_runner, "SELF_CHECK_EPS", 64)
    check_greedy_tokens(greedy, one_layer_off, head)
