"""Draft training: the `eagle-ray train` job (`job`), the Ray Train worker loop (`loop`) and
where its tensors live (`device`), run records and resumption (`run_record`), metrics loggers
(`trackers`), the training step's memory (`memory`), and the report a run ends with (`report`).
"""
