"""The configuration, in one place: one frozen dataclass per config section, each built once
by `experiment.build` from an ml_collections ConfigDict.

- model.py: `ModelConfig` (section `model`, the architecture) and the layout helpers
  (`loop_span`, `middle_span`, `flatten`); run.py: `RunConfig` (section `run`, how the
  parameters run); fields.py: building a section from a mapping;
- train.py: `TrainConfig` (section `train`); data.py: `DataConfig` (section `data`);
  mesh.py: `MeshConfig` (section `mesh`).
"""
from loopmoe_jax.config.model import *  # noqa: F401,F403  (ModelConfig, layout helpers, ...)
from loopmoe_jax.config.run import *  # noqa: F401,F403  (RunConfig, RUN_FIELDS, ...)
