"""`eagle-ray` command line: `demo`, `bench ...`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

logger = logging.getLogger("eagle_ray")


def _demo(args: argparse.Namespace) -> int:
    """Build the tiny target, run a backend on a few chat samples, report supervision shapes."""
    import torch
    from transformers import AutoTokenizer

    from eagle_ray.data import collate, tokenize_chat
    from eagle_ray.hf_target import HFEagle3TargetModel
    from eagle_ray.testing import generate_chat_samples, tiny_target

    model_path = args.model or tiny_target(args.arch)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    rows = [tokenize_chat(tokenizer, s["messages"])
            for s in generate_chat_samples(args.samples, seed=1)]
    input_ids, attention_mask, loss_mask = collate(rows, pad_id=tokenizer.pad_token_id)
    target = HFEagle3TargetModel.from_pretrained(model_path, dtype=torch.float32)
    batch = target.generate_batch(input_ids, attention_mask, loss_mask)
    logger.info("target %s: %d layers, aux layer ids %s (post-layer convention)",
                model_path, target.num_hidden_layers, target.aux_layer_ids)
    for name, tensor in batch.tensors().items():
        logger.info("  %-18s %-22s %s", name, str(list(tensor.shape)), tensor.dtype)
    tokens = int(attention_mask.sum())
    supervised = int(batch.loss_mask.sum())
    logger.info("%d tokens (%d supervised), %d bytes per token in the %s encoding", tokens,
                supervised, batch.nbytes // input_ids.numel(), batch.encoding)
    return 0


def _bench(args: argparse.Namespace) -> int:
    import torch

    from eagle_ray.bench import backends, encodings, handoff
    from eagle_ray.hf_target import HFEagle3TargetModel
    from eagle_ray.supervision import DraftVocab
    from eagle_ray.testing import tiny_target
    from eagle_ray.vllm_target import VLLMEagle3TargetModel

    if args.which == "encodings":
        encodings.run()
        return 0
    if args.which == "handoff":
        handoff.run()
        return 0
    model_path = tiny_target(args.arch)
    if args.which == "engine-start":
        backends.run_engine_start(str(model_path))
        return 0
    hf = HFEagle3TargetModel.from_pretrained(model_path, dtype=torch.float32)
    half_vocab = DraftVocab.from_token_counts(torch.ones(hf.vocab_size), hf.vocab_size // 2)
    hf = HFEagle3TargetModel(hf.model, hf.aux_layer_ids, draft_vocab=half_vocab)
    backends.run_measured_bytes(hf)
    vllm = VLLMEagle3TargetModel.from_pretrained(model_path, dtype="float32")
    backends.run_backends({"hf": hf, "vllm": vllm}, baseline="hf")
    vllm.shutdown()
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="eagle-ray", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("demo", help="supervision for a few chat samples from the tiny target")
    demo.add_argument("--model", help="target model folder (default: the tiny built-in target)")
    demo.add_argument("--arch", default="llama", choices=["llama", "qwen3"],
                      help="tiny target architecture when --model is not given")
    demo.add_argument("--samples", type=int, default=4, help="chat samples in the micro-batch")
    demo.set_defaults(func=_demo)

    bench = sub.add_parser("bench", help="benchmarks; print JSON lines")
    bench.add_argument("which", choices=["backends", "encodings", "handoff", "engine-start"])
    bench.add_argument("--arch", default="llama", choices=["llama", "qwen3"])
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    # stdout carries results (JSON lines); vLLM logs to stdout unless told otherwise.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
