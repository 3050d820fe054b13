"""One process of a two-process CPU training run (used by test_multiprocess.py)."""
import json
import os
import sys

import jax

pid, port, work = int(sys.argv[1]), sys.argv[2], sys.argv[3]
jax.config.update('jax_num_cpu_devices', 1)
jax.config.update('jax_platforms', 'cpu')
jax.distributed.initialize(coordinator_address=f'127.0.0.1:{port}', num_processes=2,
                           process_id=pid)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_train import tiny  # noqa: E402
from loopmoe_jax.train.trainer import train  # noqa: E402

summary = train(tiny(steps=4), work)
print('RESULT', json.dumps({'process': jax.process_index(), 'devices': jax.device_count(),
                            **summary}), flush=True)
