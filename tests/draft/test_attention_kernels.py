"""Every draft kind's attention calls are ones a memory-efficient CUDA kernel takes, and
`eagle-ray plan` measures the kernel CUDA picks (issue 52, item 1).

On CUDA, flash attention refuses an explicit mask and fp32, the memory-efficient kernel refuses
grouped-query heads, and what neither takes runs on the math kernel, which materialises fp32
scores `[B, h, Lq, Lk]`. The CPU's flash kernel takes every such call, so no CPU run shows the
difference: these tests check the calls themselves (the dispatcher's rules vary by PyTorch
version and cannot be asked on a CPU) and the plan's figure with the old DFlash call as control.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from eagle_ray.draft import dflash
from eagle_ray.draft.attention import grouped_query_attention, ttt_attention
from eagle_ray.draft.kinds import build_draft
from eagle_ray.draft.model import DraftConfig
from eagle_ray.plan import trainer_memory
from eagle_ray.train.memory import (
    TensorMemoryProbe,
    cuda_attention_kernels,
    cuda_sdpa_kernel,
)

HEADS, KV_HEADS, HEAD_DIM = 4, 2, 64  # grouped-query: two query heads per key / value head


def gqa_config(num_layers: int = 1) -> DraftConfig:
    return DraftConfig(hidden_size=HEADS * HEAD_DIM, target_hidden_size=HEADS * HEAD_DIM,
                       num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                       head_dim=HEAD_DIM, intermediate_size=128, vocab_size=64,
                       draft_vocab_size=32, num_layers=num_layers)


def math_kernel_reason(q: torch.Tensor, k: torch.Tensor, mask, dtype: torch.dtype) -> str | None:
    """Why CUDA would run this call on the math kernel, written from the rules above (not from
    the product's own `cuda_sdpa_kernel`): grouped-query heads with a mask, or in fp32."""
    if k.shape[1] == q.shape[1]:
        return None
    if mask is not None:
        return f"explicit mask with {k.shape[1]} key/value heads for {q.shape[1]} query heads"
    if dtype not in (torch.float16, torch.bfloat16):
        return f"grouped-query heads in {dtype}"
    return None


@pytest.fixture
def recorded_attention(monkeypatch):
    """Every `F.scaled_dot_product_attention` call: (q, k, mask, compute dtype)."""
    calls, original = [], F.scaled_dot_product_attention

    def record(q, k, v, attn_mask=None, **kwargs):
        autocast = torch.is_autocast_enabled("cpu")
        calls.append((q.shape, k.shape, attn_mask is not None,
                      torch.get_autocast_dtype("cpu") if autocast else q.dtype))
        return original(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", record)
    return calls


def training_step(kind: str, bf16: bool, seq: int = 12, depth: int = 3) -> None:
    torch.manual_seed(0)
    config = gqa_config(num_layers=2)
    draft = build_draft(kind, config, mask_token_id=0, anchors_per_row=4)
    ids = torch.randint(1, config.vocab_size, (2, seq))
    ones = torch.ones(2, seq, dtype=torch.long)
    aux = torch.randn(2, seq, 3 * config.target_hidden_size)
    probs = torch.softmax(torch.randn(2, seq, config.draft_vocab_size), -1)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, _, _ = draft.objective(draft, aux, ids, ones, probs, ones, depth)
    loss.backward()


def offending(calls) -> list[str]:
    return [reason for q, k, mask, dtype in calls
            if (reason := math_kernel_reason(torch.empty(q, device="meta"),
                                             torch.empty(k, device="meta"),
                                             mask or None, dtype))]


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])
@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash"])
def test_no_draft_attention_call_would_run_on_cudas_math_kernel(recorded_attention, kind,
                                                                bf16):
    training_step(kind, bf16)
    assert recorded_attention, "the step made no attention call"
    assert offending(recorded_attention) == []


def old_dflash_call(q, k, v, *, scale, is_causal=False, mask=None):
    """The call DFlash made before the fix: the mask together with grouped-query heads."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal,
                                          scale=scale, enable_gqa=True)


def test_control_the_old_dflash_call_is_caught(recorded_attention, monkeypatch):
    monkeypatch.setattr(dflash, "grouped_query_attention", old_dflash_call)
    training_step("dflash", bf16=True)
    assert offending(recorded_attention)
    assert all("explicit mask" in reason for reason in offending(recorded_attention))


@pytest.mark.parametrize("masked", [True, False])
def test_repeated_heads_compute_what_grouped_heads_do(masked):
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, h, 9, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    mask = torch.rand(2, 1, 9, 9) > 0.3 if masked else None
    if masked:
        mask[..., 0] = True  # every query sees a key
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=not masked,
                                              enable_gqa=True)
    got = grouped_query_attention(q, k, v, scale=1 / math.sqrt(HEAD_DIM), mask=mask,
                                  is_causal=not masked)
    torch.testing.assert_close(got, expected)


def dflash_step_peak(kernels_seen: list[str]) -> int:
    """Peak bytes of one DFlash training step on fake tensors under `cuda_attention_kernels`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    config = gqa_config(num_layers=1)
    with torch.device("meta"):
        draft = build_draft("dflash", config, mask_token_id=0, anchors_per_row=64)
    seq = 256
    with FakeTensorMode(allow_non_fake_inputs=True):
        draft = draft.to_empty(device="cpu")
        with TensorMemoryProbe() as probe, cuda_attention_kernels() as picked:
            ids = torch.zeros(1, seq, dtype=torch.long)
            ones = torch.ones(1, seq, dtype=torch.long)
            probs = torch.empty(1, seq, config.draft_vocab_size)
            aux = torch.empty(1, seq, 3 * config.target_hidden_size)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss, _, _ = draft.objective(draft, aux, ids, ones, probs, ones, 7)
            loss.backward()
    kernels_seen.extend(picked)
    return probe.peak


def test_the_plan_counts_the_math_kernels_scores_where_cuda_would_run_it(monkeypatch):
    fixed: list[str] = []
    fixed_peak = dflash_step_peak(fixed)
    assert fixed and "math" not in fixed
    monkeypatch.setattr(dflash, "grouped_query_attention", old_dflash_call)
    old: list[str] = []
    old_peak = dflash_step_peak(old)
    assert set(old) == {"math"}
    queries, keys = 64 * 8, 256 + 64 * 8  # anchors x block, context + blocks
    scores = HEADS * queries * keys * 4  # fp32, one layer
    assert old_peak - fixed_peak >= scores


def test_trainer_memory_measures_under_cudas_kernels(monkeypatch):
    """The plan's own entry point: the old call costs the math kernel's scores there too."""
    config = gqa_config()

    def step_peak() -> int:
        return trainer_memory(config, rows=1, seq=256, ttt_steps=7,
                              supervision_dtype=torch.bfloat16, bf16=True, ddp=False,
                              kind="dflash", anchors_per_row=64)["step_peak"]

    fixed = step_peak()
    monkeypatch.setattr(dflash, "grouped_query_attention", old_dflash_call)
    assert step_peak() - fixed >= HEADS * (64 * 8) * (256 + 64 * 8) * 4


def test_ttt_attention_at_head_dim_256_stays_off_the_math_kernel():
    """TTT attention pads the head dim by up to 10: at 256 (Gemma, Qwen3-Next shapes) flash
    cannot take it, so the key / value heads are repeated for the memory-efficient kernel."""
    torch.manual_seed(2)
    q = torch.randn(1, HEADS, 16, 256, dtype=torch.bfloat16)
    keys = [torch.randn(1, KV_HEADS, 16, 256, dtype=torch.bfloat16) for _ in range(2)]
    with cuda_attention_kernels() as picked:
        ttt_attention(q, keys, [k.clone() for k in keys], 1 / 16)
    assert picked and "math" not in picked
    # The control: the same padded call with grouped-query heads would run on math.
    padded_q, padded_k = q.new_empty(1, HEADS, 17, 264), q.new_empty(1, KV_HEADS, 17, 264)
    assert cuda_sdpa_kernel(padded_q, padded_k, None) == "math"


def test_the_math_kernels_stand_in_computes_what_sdpa_does():
    """Where the plan routes a call to the math kernel it still computes attention (a boolean
    mask masks, as CUDA's bias does), so a real run under `cuda_attention_kernels` is right."""
    torch.manual_seed(3)
    q, k, v = (torch.randn(1, h, 9, HEAD_DIM) for h in (HEADS, KV_HEADS, KV_HEADS))
    mask = torch.rand(1, 1, 9, 9) > 0.4
    mask[..., 0] = True
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    with cuda_attention_kernels() as picked:
        got = old_dflash_call(q, k, v, scale=1 / math.sqrt(HEAD_DIM), mask=mask)
    assert picked == ["math"]
    torch.testing.assert_close(got, expected)
