"""A fix for sampled speculative decoding on vLLM 0.32's CPU build (no Triton).

The CPU stand-in for the rejection sampler's `expand_kernel`
(`vllm/utils/cpu_triton_utils.py`, `_expand_kernel_impl`) hands its C++ op
`_ensure_int64(output)`: for the float32 temperature buffer (and top-p / top-k) that is a new
int64 tensor, so the op writes the copy and the caller's buffer (`x.new_empty(num_tokens)` in
`expand_batch_to_tokens`, `vllm/v1/sample/rejection_sampler.py`) keeps uninitialised memory.
`apply_sampling_constraints` then divides the target's logits by it: every sampled verify step
accepts or resamples against a garbage distribution (measured on the tiny kit at t = 1:
acceptance 1.01, mean log-probability of the emitted tokens -6.1 against -0.5 for the target
alone). Greedy requests never reach it. Upstream: vllm-project/vllm#55005.

`install` replaces the stand-in with one that writes the caller's buffer at its own dtype. It
must run in vLLM's worker process before the worker registers its kernel overrides: the
`vllm.general_plugins` entry point (`plugin.register`) runs there first. Where Triton runs the
real kernel (GPU builds) it does nothing, and `EAGLE_RAY_CPU_SAMPLING_FIX=0` leaves vLLM's
kernel as shipped (to reproduce the defect). `scripts/repro_vllm_sampling.py` reproduces the
defect and the fix; tests/backends/test_vllm_sampling.py holds both.
"""

from __future__ import annotations

import os

import torch

SWITCH = "EAGLE_RAY_CPU_SAMPLING_FIX"  # "0": keep vLLM's kernel as shipped

ORIGINAL = "_expand_kernel_impl_before_eagle_ray"  # where `install` keeps vLLM's stand-in


def expand_kernel(output: torch.Tensor, input_val: torch.Tensor, cu_num_tokens: torch.Tensor,
                  replace_from, replace_to, MAX_NUM_TOKENS=None) -> None:  # noqa: N803 (vLLM's)
    """`output[cu[i-1]:cu[i]] = input_val[i]`, `replace_from` read as `replace_to` (compared at
    the input's dtype, as the Triton kernel does), written into `output` itself."""
    cu = cu_num_tokens.to(torch.int64)
    counts = torch.diff(cu, prepend=cu.new_zeros(1))
    values = torch.where(input_val == replace_from,
                         torch.tensor(replace_to, dtype=input_val.dtype), input_val)
    n = int(cu[-1]) if cu.numel() else 0
    output[:n] = values.repeat_interleave(counts).to(output.dtype)


def install() -> bool:
    """Put `expand_kernel` in place of vLLM's CPU stand-in (and of an override already
    registered in this process). False where Triton runs the real kernel, or `SWITCH` is 0."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON or os.environ.get(SWITCH, "1") == "0":
        return False
    import vllm.utils.cpu_triton_utils as cpu_triton
    import vllm.v1.sample.rejection_sampler as rejection_sampler
    from vllm.triton_utils import dispatcher

    if not hasattr(cpu_triton, ORIGINAL):
        setattr(cpu_triton, ORIGINAL, cpu_triton._expand_kernel_impl)
    cpu_triton._expand_kernel_impl = expand_kernel
    if isinstance(rejection_sampler.expand_kernel, dispatcher.KernelOverride):
        rejection_sampler.expand_kernel._impl = expand_kernel
    return True


def sampled_verify_check(fixed: bool, seeded: bool = False, vocab: int = 16,
                         requests: int = 20000) -> dict[str, float]:
    """One verify step of vLLM's rejection sampler (its CPU overrides, in this process) over
    `requests` requests at temperature 1, each drafting the target's argmax: the draft must be
    accepted with probability p(draft), and the emitted token must follow the target's softmax.
    `fixed`: with `expand_kernel`, else vLLM's stand-in. Returns the acceptance rate, its
    expectation and the total variation between the emitted tokens and the softmax."""
    import types

    import vllm.utils.cpu_triton_utils as cpu_triton
    import vllm.v1.sample.rejection_sampler as rejection_sampler
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    if not isinstance(rejection_sampler.expand_kernel, dispatcher.KernelOverride):
        current_platform.register_triton_kernel_overrides()  # what a vLLM worker does
    kernel = rejection_sampler.expand_kernel
    before = kernel._impl
    kernel._impl = expand_kernel if fixed else getattr(cpu_triton, ORIGINAL,
                                                       cpu_triton._expand_kernel_impl)
    try:
        logits = torch.randn(vocab, generator=torch.Generator().manual_seed(0)) * 2
        p = logits.softmax(-1)
        draft = int(p.argmax())
        generators = ({i: torch.Generator().manual_seed(1000 + i) for i in range(requests)}
                      if seeded else {})
        metadata = types.SimpleNamespace(
            all_greedy=False, all_random=True, top_k=None, top_p=None,
            temperature=torch.ones(requests, dtype=torch.float32), generators=generators)
        cu = torch.arange(1, requests + 1, dtype=torch.int32)
        scaled = rejection_sampler.apply_sampling_constraints(
            logits.repeat(requests, 1).contiguous(), cu, metadata)
        out = rejection_sampler.rejection_sample(
            torch.full((requests,), draft, dtype=torch.int32), [1] * requests, 1, cu, None,
            scaled, torch.full((requests, 1), vocab, dtype=torch.int64), metadata)
    finally:
        kernel._impl = before
    first = out[:, 0].long().clamp(0, vocab - 1)
    emitted = torch.bincount(first, minlength=vocab).float() / requests
    return {"accept_rate": float((first == draft).float().mean()),
            "expected_accept_rate": float(p[draft]),
            "total_variation": float(0.5 * (emitted - p).abs().sum())}
