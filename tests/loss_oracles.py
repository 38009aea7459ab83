"""Independent computations of the training losses (eagle_ray/contract/losses.py), slot by slot
in Python floats from each formula, and speculators 0.9's own functions as a second oracle.

speculators is a test-only dependency (`scripts/setup_env.sh` installs it with `--no-deps`);
its package `__init__` imports its models and data pipeline (`datasets`, ...), which the test
environment lacks, so `speculators_module` registers the package without running that file and
imports only the torch-only modules the tests read (`losses/eager.py`, `losses/utils.py`).
"""

import importlib
import importlib.metadata
import math
import sys
import types


def softmax(logits: list[float]) -> list[float]:
    top = max(logits)
    exps = [math.exp(z - top) for z in logits]
    return [e / sum(exps) for e in exps]


def slot_value(name: str, logits: list[float], p: list[float], eta: float = 3.0) -> float:
    """Loss `name` at one slot: draft logits, target probabilities (plain lists)."""
    q = softmax(logits)
    kl_pq = sum(pi * math.log(pi / qi) for pi, qi in zip(p, q, strict=True) if pi > 0)
    tv = 0.5 * sum(abs(pi - qi) for pi, qi in zip(p, q, strict=True))
    alpha = sum(min(pi, qi) for pi, qi in zip(p, q, strict=True))
    if name == "forward_kl":
        return -sum(pi * math.log(qi) for pi, qi in zip(p, q, strict=True))
    if name == "reverse_kl":
        return sum(qi * math.log(qi / pi) for pi, qi in zip(p, q, strict=True))
    if name == "jensen_shannon":
        m = [(pi + qi) / 2 for pi, qi in zip(p, q, strict=True)]
        return 0.5 * sum(pi * math.log(pi / mi) for pi, mi in zip(p, m, strict=True) if pi > 0) \
            + 0.5 * sum(qi * math.log(qi / mi) for qi, mi in zip(q, m, strict=True))
    if name == "total_variation":
        return tv
    if name == "neg_log_acceptance":
        return -math.log(max(alpha, 1e-5))
    if name == "lk_hybrid":
        weight = math.exp(-eta * alpha)
        return weight * kl_pq + (1 - weight) * tv
    raise ValueError(name)


def slot_values(name: str, logits, probs, eta: float = 3.0) -> list[float]:
    """`slot_value` at every slot of `[..., V]` tensors, one slot at a time, in order."""
    flat_logits = logits.reshape(-1, logits.shape[-1]).double().tolist()
    flat_probs = probs.reshape(-1, probs.shape[-1]).double().tolist()
    return [slot_value(name, z, p, eta) for z, p in zip(flat_logits, flat_probs, strict=True)]


def masked_mean_of_slots(name: str, logits, probs, mask, eta: float = 3.0) -> float:
    """The mean of `slot_value` over the slots `mask` `[...]` marks."""
    values = [value for value, keep in zip(slot_values(name, logits, probs, eta),
                                           mask.reshape(-1).tolist(), strict=True) if keep]
    return sum(values) / max(len(values), 1)


def dpace_block_weights(confidence: list[float], valid: list[bool], alpha: float) -> list[float]:
    """D-PACE's Eq. 8 for one block, by its sums and products: slot j's weight is the sum over
    supervised m >= j of the product over i <= m of the smoothed confidences (1 where a slot is
    not supervised); 0 at unsupervised slots."""
    smooth = [(1 - alpha) * c + alpha if v else 1.0 for c, v in zip(confidence, valid, strict=True)]
    weights = []
    for j, keep in enumerate(valid):
        total = 0.0
        for m in range(j, len(valid)):
            if valid[m]:
                total += math.prod(smooth[: m + 1])
        weights.append(total if keep else 0.0)
    return weights


def speculators_module(name: str) -> types.ModuleType:
    """`speculators.<name>` without the package's `__init__` (see the module docstring)."""
    if "speculators" not in sys.modules:
        try:
            root = importlib.metadata.distribution("speculators").locate_file("speculators")
        except importlib.metadata.PackageNotFoundError:
            raise RuntimeError("speculators 0.9.0 is the loss tests' second oracle: run "
                               "scripts/setup_env.sh (make setup), which installs it with "
                               "--no-deps") from None
        version = importlib.metadata.version("speculators")
        if version != "0.9.0":
            raise RuntimeError(f"the loss tests read speculators 0.9.0's functions, found "
                               f"{version}: run scripts/setup_env.sh")
        package = types.ModuleType("speculators")
        package.__path__ = [str(root)]
        sys.modules["speculators"] = package
    return importlib.import_module(f"speculators.{name}")
