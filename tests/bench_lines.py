"""Running `eagle-ray bench` as a user does and reading its JSON lines back, checked for the
fields every line carries."""

import json
import math
import sys
from pathlib import Path

EAGLE_RAY = str(Path(sys.executable).parent / "eagle-ray")


def result_lines(stdout: str) -> list[dict]:
    """The benchmark's result lines, each checked for the fields every line carries."""
    records = [json.loads(line) for line in stdout.splitlines()]
    for record in records:
        assert {"bench", "metric", "value", "unit"} <= set(record), record
        assert isinstance(record["value"], int | float) and math.isfinite(record["value"]), record
        if "baseline" in record:  # a comparison carries its ratio, measured in the same run
            assert isinstance(record["ratio"], int | float), record
    return records
