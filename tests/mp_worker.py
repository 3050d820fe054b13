"""One process of two-process CPU training runs (used by test_multiprocess.py): N CPU devices
per process; one run per argument 'axis=size,...[:sample|:half]' (a mesh spanning both
processes; `sample`: the default train.sample_tokens; `half`: 3 of a 6-step schedule, for a
resume elsewhere), in WORK/<i>, one after another in the same two processes. Prints what each
run fed."""
import json
import os
import sys

import jax
import numpy as np

pid, port, work, n_dev, specs = (int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]),
                                 sys.argv[5:])
jax.config.update('jax_num_cpu_devices', n_dev)
jax.config.update('jax_platforms', 'cpu')
jax.distributed.initialize(coordinator_address=f'127.0.0.1:{port}', num_processes=2,
                           process_id=pid)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import tiny  # noqa: E402
from loopmoe_jax.train import step as steps  # noqa: E402
from loopmoe_jax.train.trainer import train  # noqa: E402

fed = []
put_batch = steps.put_batch


def recording_put_batch(batch, batch_sh, batch_size=None):
  if batch_sh.mesh.size == jax.device_count() and len(fed) < 6:  # training and validation rows fed here
    fed.append(np.asarray(batch['inputs']).tolist())
  return put_batch(batch, batch_sh, batch_size)


steps.put_batch = recording_put_batch
for i, spec in enumerate(specs):
  mesh, _, option = spec.partition(':')
  fed.clear()
  cfg = tiny(steps=3, schedule_steps=6) if option == 'half' else tiny(steps=4)
  if option == 'sample':
    from loopmoe_jax.config.train import TrainConfig  # noqa: E402
    cfg.train.sample_tokens = TrainConfig().sample_tokens
  for axis_size in mesh.split(','):  # e.g. data=1,expert=4
    axis, size = axis_size.split('=')
    cfg.mesh[axis] = int(size)
  summary = train(cfg, os.path.join(work, str(i)))
  print('RESULT', json.dumps({'run': i, 'process': jax.process_index(),
                              'devices': jax.device_count(), 'fed': fed, **summary}),
        flush=True)
