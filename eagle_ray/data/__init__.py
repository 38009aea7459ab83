"""Chat data on its way to training: read and streamed through Ray Data (`ingest`), rendered
with the target's chat template (`chat`, `tokenizer_files`) into token rows (`tokenize`),
packed into micro-batches (`micro_batches`), and the draft vocabulary counted from it
(`draft_vocab`). Also the two jobs that rewrite or precompute data through the pool:
regenerating the answers with the target (`regenerate`) and writing its supervision once to a
cache training can read without a target (`supervision_cache`, `cache_job`).
"""
