"""Samples text from a checkpoint.

    python scripts/generate.py --workdir=/tmp/run --prompt='def ' --tokens=200 [--step=300]
        [--kv_cache=last_pass]   # the core's KV cache shared by the passes (decode.py)
"""
import math

from absl import flags

from loopmoe_jax.cli import distributed_flags, initialize_distributed, main_process, run

_WORKDIR = flags.DEFINE_string('workdir', None, 'Run directory.', required=True)
_PROMPT = flags.DEFINE_string('prompt', 'def ', 'Prompt text.')
_TOKENS = flags.DEFINE_integer('tokens', 200, 'Tokens to generate.')
_TEMP = flags.DEFINE_float('temperature', 0.8, 'Sampling temperature (0: greedy).')
_SEED = flags.DEFINE_integer('seed', 0, 'Sampling seed.')
_LOOPS = flags.DEFINE_integer('num_loops', None, 'Passes through the core (tied models).')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step (default: latest readable).')
_SCALE = flags.DEFINE_enum('scale_passes', None, ['trained', 'executed'],
                           'r of the 1/r residual scale at another pass count.')
_KV = flags.DEFINE_string('kv_cache', None, "The core's KV-cache layout, model.kv_cache "
                          "(per_pass, last_pass, first_pass; default: the model's).")
_DISTRIBUTED = distributed_flags()


def check_sampling(temperature: float, tokens: int) -> None:
  """The sampling flags, before the checkpoint loads: a ValueError naming the flag."""
  if not (math.isfinite(temperature) and temperature >= 0):
    raise ValueError(f'--temperature={temperature}: must be a finite number >= 0 (0: greedy)')
  if tokens < 1:
    raise ValueError(f'--tokens={tokens}: must be >= 1')


def main(argv):
  del argv
  check_sampling(_TEMP.value, _TOKENS.value)
  initialize_distributed(_DISTRIBUTED)  # every process samples the same; process 0 prints
  from loopmoe_jax.train.evaluation import sample_text
  text = sample_text(_WORKDIR.value, _PROMPT.value, _TOKENS.value, _TEMP.value, _SEED.value,
                    _LOOPS.value, _STEP.value, _SCALE.value, _KV.value)
  if main_process():
    print(text)


if __name__ == '__main__':
  run(main)
