"""Where tensors live (docs/contract.md): a backend whose engine output sits on a GPU returns
one-device batches for every encoding, on CPU-only machines too.

The GPU is PyTorch's `FakeTensorMode`: tensors on a fake "cuda" device that carry shapes,
dtypes and devices but no data, with the device checks a real GPU makes (a CUDA tensor masked
with a CPU mask raises). Value checks that read data (`validate_micro_batch`'s numpy checks)
cannot run on fake tensors and are not what these tests are about; they are tested elsewhere.
"""

import contextlib

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

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
    """Stands in for the CUDA runtime calls eagle_ray makes, recording them in `log`: events
    recorded (on which stream), events the host waits for, streams made to wait for an event,
    device-wide syncs; `RecordedCopies` adds every copy between devices. One GPU: its default
    stream is "stream of cuda:0", a stream the code makes is "side stream"."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.recorded_at: dict[int, int] = {}  # log index of a host wait -> of its event's record
        self.current = None  # the stream a `torch.cuda.stream` block made current
        recorded = self

        class Event:
            def record(self, stream=None):
                self.stream = (stream or recorded.current_stream()).name
                self.at = len(recorded.log)
                recorded.log.append(("record", self.stream))

            def synchronize(self):
                recorded.recorded_at[len(recorded.log)] = self.at
                recorded.log.append(("host waits", self.stream))

            def query(self):
                return True

        class Stream:
            def __init__(self, name="side stream"):
                self.name = name

            def wait_event(self, event):
                recorded.log.append(("stream waits", self.name, event.stream))

        self.Event, self.Stream = Event, Stream
        self.default = Stream("stream of cuda:0")

    def current_stream(self, device=None):
        return self.current or self.default

    @contextlib.contextmanager
    def stream(self, stream):
        self.current, before = stream, self.current
        try:
            yield
        finally:
            self.current = before

    def synchronize(self, device=None):
        self.log.append(("device-wide sync", str(device)))


class RecordedCopies(TorchDispatchMode):
    """Logs each copy between devices into `cuda.log` as CUDA would run it: ("copy", stream,
    "async" or "synchronising", "to cuda" or "to cpu"). Asynchronous: non-blocking with the host
    side pinned (a non-blocking `.to("cpu")` allocates pinned memory); every other copy makes
    the host wait for the stream, as does advanced indexing of a GPU tensor with host indices
    (an implicit synchronising copy of the indices)."""

    def __init__(self, cuda: RecordedCuda) -> None:
        super().__init__()
        self.cuda = cuda

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        hop = copy_between_devices(func, args, kwargs)
        if hop is not None:
            self.cuda.log.append(("copy", self.cuda.current_stream().name, *hop))
        return func(*args, **kwargs)


def copy_between_devices(func, args, kwargs) -> tuple[str, str] | None:
    """(how, where to) if `func` copies between devices, else None."""
    aten = torch.ops.aten
    if func is aten.index.Tensor:
        indices = [i for i in args[1] if i is not None and i.device.type != args[0].device.type]
        return ("synchronising", f"to {args[0].device.type}") if indices else None
    if func is aten._to_copy.default:
        source, target = args[0], kwargs.get("device", args[0].device)
        non_blocking = kwargs.get("non_blocking", False)
        pinned = target.type == "cpu" or source.is_pinned()
    elif func is aten.copy_.default:
        source, target = args[1], args[0].device
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        pinned = (args[0] if target.type == "cpu" else source).is_pinned()
    else:
        return None
    if source.device.type == target.type:
        return None
    return ("async" if non_blocking and pinned else "synchronising"), f"to {target.type}"


def pinned_copy(tensor: torch.Tensor) -> torch.Tensor:
    """`pin_memory()` on a CPU build (which cannot pin): a copy marked as pinned."""
    copy = tensor.clone()
    copy.pinned = True
    return copy


@pytest.fixture
def recorded_cuda(fake_gpu, monkeypatch):
    """Fake CUDA tensors with the copy bookkeeping of a real GPU: eagle_ray sees a GPU, and its
    CUDA calls and copies are recorded."""
    import eagle_ray.devices as devices

    cuda = RecordedCuda()
    monkeypatch.setattr(devices, "_real_gpu", lambda device: device.type == "cuda")
    for name in ("Event", "Stream", "current_stream", "stream", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    monkeypatch.setattr(torch.Tensor, "pin_memory", pinned_copy)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: getattr(self, "pinned", False))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    with RecordedCopies(cuda):
        yield cuda


def test_the_recorded_copies_tell_a_synchronising_copy_from_an_asynchronous_one(recorded_cuda):
    """The control of the copy bookkeeping: what makes the host wait on a GPU is logged so."""
    on_gpu = torch.empty(4, 8, device="cuda:0")
    host = torch.arange(4)
    host.to("cuda:0")
    host.to("cuda:0", non_blocking=True)  # pageable: staged by the host
    host.pin_memory().to("cuda:0", non_blocking=True)
    on_gpu.to("cpu")
    on_gpu.to("cpu", non_blocking=True)
    torch.ops.aten.index.Tensor(on_gpu, [host])  # `on_gpu[host]`: the indices copied first
    torch.ops.aten.index.Tensor(on_gpu, [host.pin_memory().to("cuda:0", non_blocking=True)])
    stream = "stream of cuda:0"
    assert recorded_cuda.log == [
        ("copy", stream, "synchronising", "to cuda"), ("copy", stream, "synchronising", "to cuda"),
        ("copy", stream, "async", "to cuda"), ("copy", stream, "synchronising", "to cpu"),
        ("copy", stream, "async", "to cpu"), ("copy", stream, "synchronising", "to cuda"),
        ("copy", stream, "async", "to cuda")]


def test_a_copy_to_the_host_returns_only_once_an_event_behind_it_has_fired(recorded_cuda):
    from eagle_ray.devices import hand_over

    on_gpu = [torch.empty(4, 8, device="cuda"), torch.empty(4, device="cuda")]
    moved = hand_over(on_gpu + [torch.empty(3)], "cpu")
    assert [t.device.type for t in moved] == ["cpu"] * 3
    # The copies overlap; one event per hop (the source's stream), waited for by the host;
    # nothing device-wide.
    stream = "stream of cuda:0"
    assert recorded_cuda.log == [("copy", stream, "async", "to cpu")] * 2 + [
        ("record", stream), ("host waits", stream)]


def test_a_copy_to_the_gpu_and_a_copy_that_is_not_one_wait_for_nothing(recorded_cuda):
    from eagle_ray.devices import hand_over

    moved = hand_over([torch.empty(4, 8).pin_memory(), torch.empty(2, device="cuda")], "cuda:0")
    assert [t.device.type for t in moved] == ["cuda", "cuda"]
    assert recorded_cuda.log == [("copy", "stream of cuda:0", "async", "to cuda")], \
        "the GPU's stream orders what reads a host-to-device copy"


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


def host_tensor(buffers, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A tensor from a use of `buffers` that no GPU reads."""
    with buffers.use() as empty:
        return empty(shape, dtype)


def test_host_buffers_are_reused_only_once_nothing_views_them():
    """What a replica shifts supervision into: the same memory again for the next batch, but
    never while Ray may still read the last one (a numpy array derived from it)."""
    from eagle_ray.devices import HostBuffers

    buffers = HostBuffers(max_buffers=2)
    first = host_tensor(buffers, (4, 8), torch.bfloat16)
    address = first.data_ptr()
    as_numpy = first.view(torch.int16).numpy()  # what `batch_to_numpy` hands Ray
    del first
    second = host_tensor(buffers, (4, 8), torch.bfloat16)
    assert second.data_ptr() != address, "still viewed by the array"
    del as_numpy
    third = host_tensor(buffers, (2, 8), torch.float32)  # as many bytes or fewer: the idle one
    assert third.data_ptr() == address and third.shape == (2, 8)
    assert host_tensor(buffers, (4, 8), torch.bfloat16).data_ptr() not in (
        address, second.data_ptr())


def test_host_buffers_hand_out_the_smallest_idle_buffer_that_fits():
    from eagle_ray.devices import HostBuffers

    buffers = HostBuffers(max_buffers=3)
    small, large = host_tensor(buffers, (8,), torch.float32), host_tensor(buffers, (16,),
                                                                           torch.float32)
    addresses = small.data_ptr(), large.data_ptr()
    del small, large
    with buffers.use() as empty:  # both at once: neither is idle again before the use ends
        kept = [empty((5,), torch.float32), empty((12,), torch.float32)]
    assert tuple(t.data_ptr() for t in kept) == addresses


def unwaited_reuses(cuda: RecordedCuda) -> list[int]:
    """Buffers handed out again while an asynchronous copy issued since they were last handed
    out may still be running: the host has waited for no event recorded behind it on its
    stream. (Any such copy counts, whatever it reads: a use's event covers them all.)"""
    running: list[tuple[int, str]] = []  # (log index, stream) of copies not known to be done
    handed_out: dict[int, int] = {}  # buffer -> log index of its last hand-out
    reuses = []
    for at, entry in enumerate(cuda.log):
        if entry[:1] == ("copy",) and entry[2] == "async":
            running.append((at, entry[1]))
        elif entry[0] == "host waits":
            running = [(copy, stream) for copy, stream in running
                       if stream != entry[1] or copy > cuda.recorded_at[at]]
        elif entry[0] == "hand out":
            if entry[1] in handed_out and any(copy > handed_out[entry[1]] for copy, _ in running):
                reuses.append(entry[1])
            handed_out[entry[1]] = at
    return reuses


@pytest.mark.parametrize("fenced", [True, False], ids=["event per use", "control: none"])
def test_host_buffers_are_reused_only_once_the_gpu_has_copied_them(recorded_cuda, monkeypatch,
                                                                   fenced):
    """A co-located vLLM backend (supervision on the engine's GPU): the rows are shifted into
    host buffers, which non-blocking copies to the GPU still read after `generate_batch` has
    returned. The next call reuses the buffers (its shift overwrites them) only once the host
    has waited for an event recorded behind those copies. The control: without that event the
    same bookkeeping sees the reuse with no wait. No self-check: its `.cpu()` would hide it."""
    import eagle_ray.devices as devices
    from eagle_ray.devices import HostBuffers

    take = HostBuffers._take

    def logged_take(self, nbytes):
        buffer = take(self, nbytes)
        recorded_cuda.log.append(("hand out", id(buffer)))
        return buffer

    monkeypatch.setattr(HostBuffers, "_take", logged_take)
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self: self.device.type == "cpu")
    if not fenced:
        monkeypatch.setattr(devices, "_reads_of", lambda readers: [])
    backend = gpu_backend(layout="vllm_states_in_host_memory")
    for _ in range(2):
        batch = backend.generate_batch(*micro_batch("cpu"))
        assert batch.aux_hidden_states.device.type == "cuda"
    hand_outs = [entry[1] for entry in recorded_cuda.log if entry[0] == "hand out"]
    assert len(hand_outs) == 4 and set(hand_outs[2:]) == set(hand_outs[:2]), hand_outs
    assert (unwaited_reuses(recorded_cuda) == []) == fenced, recorded_cuda.log


BLOCK, BLOCKS, KV_HEADS = 8, 12, 4


class RecordedHandoff:
    """What the connector publishes: each key's shape."""

    def __init__(self) -> None:
        self.published: dict[str, tuple[int, ...]] = {}

    def publish(self, key: str, states: torch.Tensor) -> None:
        self.published[key] = tuple(states.shape)


def gather_through_aten(kv_cache, slots, num_tokens):
    """vLLM's `extract_from_kv_cache` in aten calls (Python indexing of a fake CUDA tensor needs
    a CUDA build)."""
    block_size = kv_cache.shape[2]
    index = [slots // block_size, None, slots % block_size]
    return torch.ops.aten.index.Tensor(kv_cache, index).narrow(0, 0, num_tokens)


def connector_for_step(lengths: dict[str, int], rank: int = 0):
    """vLLM's connector on a fake GPU's worker, bound to the metadata of a step in which the
    requests of `lengths` (request -> tokens) finished, each with blocks of its own. Built
    without its vLLM config: the worker-side state it reads is set as vLLM sets it."""
    from concurrent.futures import ThreadPoolExecutor

    from vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector import (
        ExampleHiddenStatesConnectorMetadata,
        PendingSave,
    )

    from eagle_ray.backends.vllm.connector import EagleRayHiddenStatesConnector

    saves, next_block = [], 0
    for req_id, tokens in lengths.items():
        blocks = -(-tokens // BLOCK)
        saves.append(PendingSave(req_id, "", torch.zeros(tokens, dtype=torch.long),
                                 list(range(next_block, next_block + blocks))))
        next_block += blocks
    connector = object.__new__(EagleRayHiddenStatesConnector)
    connector.__dict__.update(
        _is_tp_rank_zero=rank == 0, _tp_rank=rank, _check_ranks=True,
        _rank_rows=RecordedHandoff(), _block_size=BLOCK, _engine_tag="step",
        _kv_cache=torch.empty(BLOCKS, KV_HEADS, BLOCK, HIDDEN, device="cuda"),
        _copy_stream=None, _executor=ThreadPoolExecutor(1), _handoff=RecordedHandoff(),
        _req_copy_events={}, _req_futures={}, _accumulated_finished_req_ids=set(),
        _lock_fds={}, use_lock=False,
        _connector_metadata=ExampleHiddenStatesConnectorMetadata(pending_saves=saves))
    return connector


def connector_step(recorded_cuda, monkeypatch, lengths: dict[str, int], rank: int = 0):
    """(the connector, what its `get_finished` reported, the copies it made) for one engine
    step on TP rank `rank` in which the requests of `lengths` finished."""
    import eagle_ray.backends.vllm.connector as connector_module

    monkeypatch.setattr(connector_module, "extract_from_kv_cache", gather_through_aten)
    connector = connector_for_step(lengths, rank)
    done, _ = connector.get_finished(set(lengths))
    connector._executor.shutdown(wait=True)
    return connector, done, [entry for entry in recorded_cuda.log if entry[0] == "copy"]


def test_the_connector_copies_a_steps_states_out_with_nothing_synchronising(recorded_cuda,
                                                                            monkeypatch):
    """vLLM's worker calls `get_finished` on its main thread once per engine step: the capture
    queues its copies (the slots to the GPU, the states to the host) on the side stream behind
    the forward, all asynchronous and one of each for the step's requests together; only the
    publishing thread waits, for the copy's event. The recorded copies' control:
    `test_the_recorded_copies_tell_a_synchronising_copy_from_an_asynchronous_one`."""
    from eagle_ray.backends.vllm.handoff import handoff_key

    lengths = {"part-of-a-block": 5, "one-block": 8, "several-blocks": 27}
    connector, done, copies = connector_step(recorded_cuda, monkeypatch, lengths)
    log = recorded_cuda.log
    assert copies == [("copy", "side stream", "async", "to cuda"),
                      ("copy", "side stream", "async", "to cpu")], log
    assert log.index(("stream waits", "side stream", "stream of cuda:0")) < log.index(copies[0])
    assert log.index(copies[1]) < log.index(("host waits", "side stream"))
    assert done == set(lengths)  # vLLM's poll sees each request's copy done
    assert connector._handoff.published == {
        handoff_key("step", req_id): (tokens, KV_HEADS, HIDDEN)
        for req_id, tokens in lengths.items()}


def test_a_later_tp_rank_publishes_its_rank_check_rows_with_nothing_synchronising(
        recorded_cuda, monkeypatch):
    """A TP rank past the first copies one captured row per request (the rank check's) out of
    its KV cache on the stream that ran the forward -- it reports nothing to vLLM, so rank 0
    decides when the blocks are freed, and the next forward that could reuse them queues behind
    the gather -- asynchronously; only the publishing thread waits."""
    from eagle_ray.backends.vllm.handoff import handoff_key, rank_check_key

    lengths = {"short": 5, "long": 27}
    connector, done, copies = connector_step(recorded_cuda, monkeypatch, lengths, rank=1)
    log = recorded_cuda.log
    assert copies == [("copy", "stream of cuda:0", "async", "to cuda"),
                      ("copy", "stream of cuda:0", "async", "to cpu")], log
    assert log.index(copies[1]) < log.index(("host waits", "stream of cuda:0"))
    assert done is None, "this rank reports no request to vLLM"
    assert connector._handoff.published == {}, "rank 0 alone publishes states"
    assert connector._rank_rows.published == {
        rank_check_key(handoff_key("step", req_id), 1): (HIDDEN,) for req_id in lengths}
