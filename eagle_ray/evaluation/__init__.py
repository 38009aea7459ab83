"""How good a draft is: its acceptance length measured by vLLM serving it (`acceptance`) and by
the project's own simulation (`simulate`), on prompts from the job's held-out data or a
benchmark file (`prompts`), run where the target's GPUs are (`evaluate`).
"""
