"""The vLLM backend: `target` (the backend), `runner` (every vLLM internal it touches),
`engine_args` (the `vllm_kwargs` the capture cannot take), `handoff` and `ring_files` (how
captured states leave vLLM's worker), and the modules only vLLM loads:
`connector` (the KV-connector that captures hidden states), `plugin` (the `vllm.general_plugins`
entry point) and `mixtral` (EAGLE-3 for Mixtral, which vLLM's own class lacks); `draft_forwards`
counts a served draft's forwards in vLLM's workers (the evaluation's `worker_extension_cls`).
Importing this package does not import vLLM."""
