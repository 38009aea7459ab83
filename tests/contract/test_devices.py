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
from eagle_ray.contract.fp8 import encode_batch
from eagle_ray.contract.supervision import DraftVocab
from eagle_ray.contract.target_head import TargetHead
from eagle_ray.draft.model import DraftConfig, Eagle3Draft, shift_left

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

    def run(self, input_ids, attention_mask):
        batch, seq = input_ids.shape
        return RunnerOutput(
            aux_hidden_states=torch.empty(batch, seq, 3 * HIDDEN, device="cuda"),
            last_hidden=torch.empty(batch, seq, HIDDEN, device="cuda"),
            next_token_ids=torch.zeros(batch, dtype=torch.long) if self.greedy else None)


class VllmLayoutRunner(TargetRunner):
    """vLLM's layout on a GPU: the engine's states come back in host memory, row by row (its
    connector copies them out of the KV cache), while the head lives on the GPU."""

    def __init__(self, greedy: bool) -> None:
        self.greedy = greedy

    def run(self, input_ids, attention_mask):
        batch, seq = input_ids.shape
        return RunnerOutput(
            rows=[torch.empty(seq, 4, HIDDEN) for _ in range(batch)],
            next_token_ids=torch.zeros(batch, dtype=torch.long) if self.greedy else None)


LAYOUTS = {"states_on_gpu": GpuRunner, "vllm_states_in_host_memory": VllmLayoutRunner}


@pytest.fixture
def fake_gpu(monkeypatch):
    # Fake tensors hold no data to check values with (see the module docstring).
    monkeypatch.setattr(target_runner, "validate_micro_batch", lambda *a, **k: None)
    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


def gpu_backend(greedy: bool = False, layout: str = "states_on_gpu") -> RunnerEagle3TargetModel:
    head = TargetHead(on_fake_gpu(nn.RMSNorm(HIDDEN)), on_fake_gpu(nn.Linear(HIDDEN, VOCAB)))
    return RunnerEagle3TargetModel(
        LAYOUTS[layout](greedy), num_hidden_layers=LAYERS, vocab_size=VOCAB,
        aux_layer_ids=[1, 3, 4],
        embedding=on_fake_gpu(nn.Embedding(VOCAB, HIDDEN)), head=head,
        draft_vocab=DRAFT_VOCAB, self_check=greedy)


def micro_batch(device: str):
    input_ids = torch.zeros(3, 7, dtype=torch.long, device=device)
    return input_ids, torch.ones_like(input_ids), torch.ones_like(input_ids)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("encoding", ["last_hidden", "logits", "target_probs"])
@pytest.mark.parametrize("inputs_on", ["cpu", "cuda"])
@pytest.mark.parametrize("wanted", [None, "cpu"])  # the engine's device (co-located), the host
def test_every_encoding_comes_back_on_one_device(fake_gpu, layout, encoding, inputs_on, wanted):
    backend = gpu_backend(layout=layout)
    batch = backend.generate_batch(*micro_batch(inputs_on), encoding=encoding, device=wanted)
    expected = torch.device(wanted or "cuda")
    assert backend.device.type == "cuda"
    assert {name: t.device.type for name, t in batch.tensors().items()} == {
        name: expected.type for name in batch.tensors()}
    assert batch.encoding == encoding


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("inputs_on", ["cpu", "cuda"])
def test_the_self_check_reads_the_head_on_the_engines_device(fake_gpu, layout, inputs_on):
    """Every tensor op of the self-check runs on one device; only its verdict, a read of the
    data, is beyond fake tensors (which hold none)."""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException

    with pytest.raises(DynamicOutputShapeException):  # which rows failed: data it cannot hold
        gpu_backend(greedy=True, layout=layout).generate_batch(*micro_batch(inputs_on))


def test_fp8_is_quantised_on_the_gpu_and_lands_in_host_memory(fake_gpu):
    batch = gpu_backend().generate_batch(*micro_batch("cpu"))
    for name, values, scales, dtype in encode_batch(batch, "fp8"):
        assert values.device.type == "cpu", name
        if name in ("aux_hidden_states", "last_hidden"):
            assert values.dtype == torch.float8_e4m3fn and scales.device.type == "cpu"
            assert dtype == torch.float32


def test_the_draft_runs_on_the_gpu_from_a_gpu_batch(fake_gpu):
    """The draft's forward (positions, rotary, the sink key of `ttt_attention`) creates its
    tensors on the batch's device. (Autograd and the loss's log-softmax cannot run on fake CUDA
    tensors on a CPU build; they create no tensors of their own but `ttt_loss`'s zero. CUDA
    autocast is disabled on a CPU build, so bf16 is proven through the training loop on the
    CPU instead: tests/train/test_precision.py.)"""
    backend = gpu_backend()
    batch = backend.generate_batch(*micro_batch("cpu"))
    config = DraftConfig(hidden_size=HIDDEN, target_hidden_size=HIDDEN, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=32, intermediate_size=128,
                         vocab_size=VOCAB, draft_vocab_size=DRAFT_VOCAB.size)
    with torch.device("meta"):
        draft = Eagle3Draft(config)
    draft = on_fake_gpu(draft)
    steps = [shift_left(batch.input_ids, k) for k in range(3)]
    with torch.no_grad():
        logits = draft(batch.aux_hidden_states, steps)
    assert [step.device.type for step in logits] == ["cuda"] * 3


def test_the_fake_gpu_catches_a_device_mix_up(fake_gpu):
    """The control: the harness rejects what a GPU would, so the tests above can fail."""
    states = torch.empty(3, 7, HIDDEN, device="cuda")
    with pytest.raises(RuntimeError, match="device"):
        states.masked_fill_(torch.ones(3, 7, 1, dtype=torch.bool), 0)


class RecordedCuda:
    """Stands in for the CUDA runtime calls `eagle_ray.devices` makes, recording them: which
    streams events are recorded on, which events the host waits for, device-wide syncs."""

    def __init__(self) -> None:
        self.log: list[tuple[str, str]] = []
        recorded = self

        class Event:
            def record(self, stream=None):
                self.stream = stream or "current"
                recorded.log.append(("record", self.stream))

            def synchronize(self):
                recorded.log.append(("host waits", self.stream))

        self.Event = Event

    def current_stream(self, device=None):
        return f"stream of {device}"

    def synchronize(self, device=None):
        self.log.append(("device-wide sync", str(device)))


@pytest.fixture
def recorded_cuda(fake_gpu, monkeypatch):
    """Fake CUDA tensors with the copy bookkeeping of a real GPU: `devices` sees a GPU and its
    CUDA calls are recorded."""
    import eagle_ray.devices as devices

    cuda = RecordedCuda()
    monkeypatch.setattr(devices, "_real_gpu", lambda device: device.type == "cuda")
    monkeypatch.setattr(torch.cuda, "Event", cuda.Event)
    monkeypatch.setattr(torch.cuda, "current_stream", cuda.current_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", cuda.synchronize)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: False)  # a CPU build cannot pin
    return cuda


def test_a_copy_to_the_host_returns_only_once_an_event_behind_it_has_fired(recorded_cuda):
    from eagle_ray.devices import hand_over

    on_gpu = [torch.empty(4, 8, device="cuda"), torch.empty(4, device="cuda")]
    moved = hand_over(on_gpu + [torch.empty(3)], "cpu")
    assert [t.device.type for t in moved] == ["cpu"] * 3
    # One event per hop (the source's stream), waited for by the host; nothing device-wide.
    assert recorded_cuda.log == [("record", "stream of cuda:0"), ("host waits",
                                                                  "stream of cuda:0")]


def test_a_copy_to_the_gpu_and_a_copy_that_is_not_one_wait_for_nothing(recorded_cuda):
    from eagle_ray.devices import hand_over

    moved = hand_over([torch.empty(4, 8), torch.empty(2, device="cuda")], "cuda:0")
    assert [t.device.type for t in moved] == ["cuda", "cuda"]
    assert recorded_cuda.log == [], "the GPU's stream orders what reads a host-to-device copy"


def test_the_vllm_layout_waits_for_its_copies_before_the_host_reads_them(recorded_cuda):
    """Inputs on the GPU, states in host memory (vLLM): the inputs' copy to the host, where the
    shift runs, has landed before the shift reads it; so have the decoded logits'."""
    backend = gpu_backend(layout="vllm_states_in_host_memory")
    backend.generate_batch(*micro_batch("cuda"), encoding="logits", device="cpu")
    waits = [entry for entry in recorded_cuda.log if entry[0] == "host waits"]
    assert len(waits) == 2, recorded_cuda.log  # the inputs, then the decoded logits
    assert not [entry for entry in recorded_cuda.log if entry[0] == "device-wide sync"]


def test_no_module_but_devices_issues_a_non_blocking_copy():
    """Every asynchronous copy goes through `eagle_ray.devices`, which waits for it."""
    from pathlib import Path

    import eagle_ray

    package = Path(eagle_ray.__file__).parent
    offenders = [str(path.relative_to(package)) for path in package.rglob("*.py")
                 if "non_blocking" in path.read_text() and path.name != "devices.py"]
    assert offenders == []


def test_host_buffers_are_reused_only_once_nothing_views_them():
    """What a replica shifts supervision into: the same memory again for the next batch, but
    never while Ray may still read the last one (a numpy array derived from it)."""
    from eagle_ray.devices import HostBuffers

    buffers = HostBuffers(max_buffers=2)
    first = buffers.empty((4, 8), torch.bfloat16)
    address = first.data_ptr()
    as_numpy = first.view(torch.int16).numpy()  # what `batch_to_numpy` hands Ray
    del first
    second = buffers.empty((4, 8), torch.bfloat16)
    assert second.data_ptr() != address, "still viewed by the array"
    del as_numpy
    third = buffers.empty((2, 8), torch.float32)  # as many bytes or fewer: the idle buffer
    assert third.data_ptr() == address and third.shape == (2, 8)
    assert buffers.empty((4, 8), torch.bfloat16).data_ptr() not in (address, second.data_ptr())


def test_host_buffers_hand_out_the_smallest_idle_buffer_that_fits():
    from eagle_ray.devices import HostBuffers

    buffers = HostBuffers(max_buffers=3)
    small, large = buffers.empty((8,), torch.float32), buffers.empty((16,), torch.float32)
    addresses = small.data_ptr(), large.data_ptr()
    del small, large
    kept = [buffers.empty((5,), torch.float32), buffers.empty((12,), torch.float32)]
    assert tuple(t.data_ptr() for t in kept) == addresses
