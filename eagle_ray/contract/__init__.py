"""The target contract (docs/contract.md) as code: what a target hands a draft and how.

The batch record (`target_batch`), which layers are captured (`aux_layers`), where the next
token sits (`shift`), the encodings on the wire (`fp8`), the target's head and the draft's
supervision computed from it (`target_head`, `supervision`, `checkpoint`), and what a target
serves (`identity`). Every module here imports neither Ray nor vLLM (tests/test_imports.py), so
a replica, a trainer and a user's own loop share it.
"""
