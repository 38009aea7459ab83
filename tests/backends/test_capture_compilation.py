"""A capture engine turns off the compilation passes no run has verified the capture under,
and with TP asks its ranks for the rank check (issue 52, item 8): vLLM 0.32 turns its fused
all-reduce + RMSNorm pass on by itself where TP > 1 on Hopper with flashinfer, and that pass
rewrites the graph nodes the aux states are read from. A CPU never runs it (it needs CUDA,
flashinfer and optimisation level 2), so these tests check the arguments the backend builds for
vLLM; a pass the user sets explicitly is the control (vLLM's kwargs pass through)."""

import pytest
import torch

from eagle_ray.backends.vllm import runner as runner_module
from eagle_ray.backends.vllm.engine_args import capture_compilation_config
from eagle_ray.backends.vllm.runner import VLLMTargetRunner


class Built(Exception):
    """Raised by the recorded `build_llm`: the engine's arguments are all the test needs."""


def built_engine_kwargs(monkeypatch, tmp_path, vllm_kwargs, tp_size=2, **options) -> dict:
    recorded = {}

    def record(engine_kwargs, multiprocess, env=None):
        recorded.update(engine_kwargs)
        raise Built

    monkeypatch.setattr(runner_module, "build_llm", record)
    with pytest.raises(Built):
        VLLMTargetRunner("/nonexistent/model", capture_ids=[1, 2, 3], hidden_size=64,
                         dtype=torch.bfloat16, tp_size=tp_size, vllm_kwargs=vllm_kwargs,
                         handoff="file", handoff_dir=str(tmp_path), **options)
    return recorded


def fusion_pass(engine_kwargs: dict):
    """What the engine is told about the pass (None: vLLM decides, i.e. on where it can)."""
    config = engine_kwargs.get("compilation_config")
    if config is None or isinstance(config, int):
        return None
    passes = config.get("pass_config") or {}
    return passes.get("fuse_allreduce_rms")


@pytest.mark.parametrize("compilation_config", [
    None, 3, {"mode": 3, "cudagraph_mode": "FULL_AND_PIECEWISE"},
    {"pass_config": {"fuse_norm_quant": True}}], ids=["unset", "mode", "dict", "other-pass"])
def test_a_tensor_parallel_capture_engine_is_built_without_the_fusion_pass(
        monkeypatch, tmp_path, compilation_config):
    vllm_kwargs = {} if compilation_config is None else {"compilation_config": compilation_config}
    kwargs = built_engine_kwargs(monkeypatch, tmp_path, vllm_kwargs)
    assert kwargs["tensor_parallel_size"] == 2
    assert fusion_pass(kwargs) is False
    if isinstance(compilation_config, dict):  # everything else the user set is kept
        for key, value in compilation_config.items():
            if key != "pass_config":
                assert kwargs["compilation_config"][key] == value
        for key, value in (compilation_config.get("pass_config") or {}).items():
            assert kwargs["compilation_config"]["pass_config"][key] == value
    if compilation_config == 3:
        assert kwargs["compilation_config"]["mode"] == 3


def test_control_a_pass_the_user_asks_for_reaches_vllm(monkeypatch, tmp_path):
    kwargs = built_engine_kwargs(monkeypatch, tmp_path, {
        "compilation_config": {"pass_config": {"fuse_allreduce_rms": True}}})
    assert fusion_pass(kwargs) is True


def test_vllms_own_config_objects_are_turned_off_too():
    from vllm.config import CompilationConfig
    from vllm.config.compilation import PassConfig

    config = capture_compilation_config(CompilationConfig())
    assert config.pass_config.fuse_allreduce_rms is False
    config = capture_compilation_config({"pass_config": PassConfig()})
    assert config["pass_config"].fuse_allreduce_rms is False
    chosen = capture_compilation_config(CompilationConfig(
        pass_config={"fuse_allreduce_rms": True}))
    assert chosen.pass_config.fuse_allreduce_rms is True  # the user's choice stays
    # vLLM applies its defaults only where a pass is None: ours survives its post-init.
    assert CompilationConfig(**capture_compilation_config(None)).pass_config \
        .fuse_allreduce_rms is False


@pytest.mark.parametrize(("tp_size", "check_ranks", "asked"), [
    (2, True, True), (2, False, False), (1, True, False)],
    ids=["tp2", "tp2-self-check-off", "tp1"])
def test_the_connector_is_asked_for_the_rank_check_under_tensor_parallelism(
        monkeypatch, tmp_path, tp_size, check_ranks, asked):
    """TP ranks past the first publish their copy of the first captured layer for the runner
    to compare (tests/backends/test_vllm_target.py runs it at TP 2); not with one rank, nor
    with the self-check off (`VLLMEagle3TargetModel`'s `self_check`)."""
    kwargs = built_engine_kwargs(monkeypatch, tmp_path, {}, tp_size=tp_size,
                                 multiprocess=True, check_ranks=check_ranks)
    assert kwargs["kv_transfer_config"]["kv_connector_extra_config"]["check_ranks"] is asked
