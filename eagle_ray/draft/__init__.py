"""The EAGLE-3 draft: model, test-time-training loss, and export for vLLM."""
