"""The scale benchmark's light replica answers as a replica does: its payload is supervision a
client decodes, and it imports neither torch nor an engine (what lets 64 fit on one machine)."""

import subprocess
import sys

import numpy as np
import pytest

from eagle_ray.bench.light_replica import LAYERS_KEY, payload
from eagle_ray.config.loader import ConfigError
from eagle_ray.config.pool import PoolConfig
from eagle_ray.pool import transport


def test_its_payload_is_supervision_a_client_decodes():
    ids = np.arange(8, dtype=np.int32).reshape(2, 4)
    mask = np.ones((2, 4), dtype=bool)
    assert LAYERS_KEY == transport.LAYERS_KEY
    batch = transport.batch_from_numpy(payload(ids, mask, mask))
    assert batch.aux_hidden_states.shape == (2, 4, 3) and batch.num_aux_layers == 3
    assert batch.last_hidden.shape == (2, 4, 1)
    assert batch.input_ids.tolist() == ids.tolist() and bool(batch.loss_mask.all())


def test_it_imports_without_torch():
    code = ("import sys, eagle_ray.bench.light_replica; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_replica_class_is_a_module_and_a_class():
    assert PoolConfig().replica_class == "eagle_ray.pool.replica:TargetReplica"
    with pytest.raises(ConfigError, match="replica_class"):
        PoolConfig(replica_class="TargetReplica")
