"""Where tensors live (docs/contract.md): a backend whose engine output sits on a GPU returns
one-device batches for every encoding, on CPU-only machines too.

The GPU is PyTorch's `FakeTensorMode`: tensors on a fake "cuda" device that carry shapes,
dtypes and devices but no data, with the device checks a real GPU makes (a CUDA tensor masked
with a CPU mask raises). Value checks that read data (`validate_micro_batch`'s numpy checks)
cannot run on fake tensors and are not what these tests are about; they are tested elsewhere.
"""

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import eagle_ray.backends.base as target_runner
from eagle_ray.backends.base import RunnerEagle3TargetModel, RunnerOutput, TargetRunner
from eagle_ray.draft.model import DraftConfig, Eagle3Draft, shift_left
from eagle_ray.fp8 import encode_batch
from eagle_ray.supervision import DraftVocab
from eagle_ray.target_head import TargetHead

HIDDEN, VOCAB, LAYERS = 64, 96, 8
DRAFT_VOCAB = DraftVocab(torch.arange(0, VOCAB, 3), VOCAB)  # built from real tensors


def on_fake_gpu(module: nn.Module) -> nn.Module:
    """`module` with every parameter replaced by a fake CUDA tensor (random initialisation and
    `to_empty(device="cuda")` are not possible on a CPU build)."""
    for sub in module.modules():
        for name, param in list(sub.named_parameters(recurse=False)):
            sub._parameters[name] = nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype, device="cuda"),
                requires_grad=param.requires_grad)
    return module


class GpuRunner(TargetRunner):
    """An engine whose states come back on the GPU (as the HF runner's do on a GPU model)."""

    def __init__(self, greedy: bool) -> None:
        self.greedy = greedy
        self.input_devices: list[torch.device] = []

    def run(self, input_ids, attention_mask):
        self.input_devices.append(input_ids.device)
        batch, seq = input_ids.shape
        return RunnerOutput(
            aux_hidden_states=torch.empty(batch, seq, 3 * HIDDEN, device="cuda"),
            last_hidden=torch.empty(batch, seq, HIDDEN, device="cuda"),
            next_token_ids=torch.zeros(batch, dtype=torch.long) if self.greedy else None)


@pytest.fixture
def fake_gpu(monkeypatch):
    # Fake tensors hold no data to check values with (see the module docstring).
    monkeypatch.setattr(target_runner, "validate_micro_batch", lambda *a, **k: None)
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def gpu_backend(greedy: bool = False) -> RunnerEagle3TargetModel:
    head = TargetHead(on_fake_gpu(nn.RMSNorm(HIDDEN)), on_fake_gpu(nn.Linear(HIDDEN, VOCAB)))
    return RunnerEagle3TargetModel(
        GpuRunner(greedy), num_hidden_layers=LAYERS, vocab_size=VOCAB, aux_layer_ids=[1, 3, 4],
        embedding=on_fake_gpu(nn.Embedding(VOCAB, HIDDEN)), head=head,
        draft_vocab=DRAFT_VOCAB, self_check=greedy)


def micro_batch(device: str):
    input_ids = torch.zeros(3, 7, dtype=torch.long, device=device)
    return input_ids, torch.ones_like(input_ids), torch.ones_like(input_ids)


@pytest.mark.parametrize("encoding", ["last_hidden", "logits", "target_probs"])
@pytest.mark.parametrize("inputs_on", ["cpu", "cuda"])
@pytest.mark.parametrize("wanted", [None, "cpu"])  # the engine's device (co-located), the host
def test_every_encoding_comes_back_on_one_device(fake_gpu, encoding, inputs_on, wanted):
    backend = gpu_backend()
    batch = backend.generate_batch(*micro_batch(inputs_on), encoding=encoding, device=wanted)
    expected = torch.device(wanted or "cuda")
    assert backend.device.type == "cuda"
    assert {name: t.device.type for name, t in batch.tensors().items()} == {
        name: expected.type for name in batch.tensors()}
    assert batch.encoding == encoding


def test_the_self_check_reads_the_head_on_the_engines_device(fake_gpu):
    """Every tensor op of the self-check runs on one device; only its verdict, a read of the
    data, is beyond fake tensors (which hold none)."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    with pytest.raises(DynamicOutputShapeException):  # which rows failed: data it cannot hold
        gpu_backend(greedy=True).generate_batch(*micro_batch("cpu"))


def test_fp8_is_quantised_on_the_gpu_and_lands_in_host_memory(fake_gpu):
    batch = gpu_backend().generate_batch(*micro_batch("cpu"))
    for name, values, scales, dtype in encode_batch(batch, "fp8"):
        assert values.device.type == "cpu", name
        if name in ("aux_hidden_states", "last_hidden"):
            assert values.dtype == torch.float8_e4m3fn and scales.device.type == "cpu"
            assert dtype == torch.float32


@pytest.mark.parametrize("precision", [None, torch.bfloat16])
def test_the_draft_runs_on_the_gpu_from_a_gpu_batch(fake_gpu, precision):
    """The draft's forward (positions, rotary, the sink key of `ttt_attention`) creates its
    tensors on the batch's device. (Autograd and the loss's log-softmax cannot run on fake CUDA
    tensors on a CPU build; they create no tensors of their own but `ttt_loss`'s zero.)"""
    backend = gpu_backend()
    batch = backend.generate_batch(*micro_batch("cpu"))
    config = DraftConfig(hidden_size=HIDDEN, target_hidden_size=HIDDEN, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, intermediate_size=128,
                         vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB.size)
    with torch.device("meta"):
        draft = Eagle3Draft(config)
    draft = on_fake_gpu(draft)
    steps = [shift_left(batch.input_ids, k) for k in range(3)]
    with torch.no_grad(), torch.autocast("cuda", dtype=precision or torch.float32,
                                         enabled=precision is not None):
        logits = draft(batch.aux_hidden_states, steps)
    assert [step.device.type for step in logits] == ["cuda"] * 3


def test_the_fake_gpu_catches_a_device_mix_up(fake_gpu):
    """The control: the harness rejects what a GPU would, so the tests above can fail."""
    states = torch.empty(3, 7, HIDDEN, device="cuda")
    with pytest.raises(RuntimeError, match="device"):
        states.masked_fill_(torch.ones(3, 7, 1, dtype=torch.bool), 0)
