"""TrainConfig: optimisation, schedule, logging and checkpoint settings (config key `train`)."""
from __future__ import annotations

import dataclasses
import math

from loopmoe_jax.config.fields import from_mapping

SCHEDULES = ('wsd', 'cosine', 'constant')
# train.loops_sampler: the core's pass count per train step (train/depth.py, sample_loops)
LOOPS_SAMPLERS = ('fixed', 'uniform', 'poisson_lognormal')
DECAY_SHAPES = ('1-sqrt', 'linear', 'cosine')


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  steps: int = 300
  schedule_steps: int = 0        # length of the LR schedule; 0: `steps`
  seed: int = 0                  # init seed (the data order has its own, data.seed)
  lr: float = 3e-3               # peak learning rate
  schedule: str = 'wsd'
  warmup: int = 30
  decay_fraction: float = 0.1    # WSD: the decay occupies the last fraction of the schedule
  decay_shape: str = '1-sqrt'
  final_lr_fraction: float = 0.05
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 0.1      # not applied to norms and other 1-D params
  clip: float = 1.0              # global-norm clip; 0 disables
  lb_coef: float = 0.01
  z_coef: float = 0.001
  bias_rate: float = 0.001       # model.router_bias: step of the bias update (DeepSeek-V3's gamma)
  log_every: int = 10
  eval_every: int = 100
  save_every: int = 100
  save_every_minutes: float = 0.0  # also save when this many minutes passed since the last
  #                                  save (process 0's clock, agreed by all; 0: off)
  keep: int = 3                  # newest checkpoints kept
  keep_every: int = 0            # also keep every multiple of this step for good (0: none)
  keep_steps: str = ''           # also keep these steps for good: '45000' or '1000,45000'
  async_save: bool = True
  wandb: str = ''                # a Weights & Biases project to log to ('' off; WANDB_MODE
  #                                as W&B reads it: 'offline' keeps the run local)
  compile_cache: str = ''        # persistent compilation cache: '' WORKDIR/compile_cache, a
  #                                path, or 'off' (train/compile_cache.py)
  routing_every: int = 50        # per-layer-per-pass routing statistics
  final_window: int = 50         # summary: mean LM loss over the last W steps
  peak_flops: float = 0.0        # per device, for MFU; 0: known accelerators only
  sample_tokens: int = 200       # text sample printed at the end (0: none)
  sample_prompt: str = 'def '
  init_from: str = ''            # start from another run's checkpoint (a continuation)
  init_step: int = -1            # its step; -1: latest
  microbatches: int = 1          # gradient accumulation: the batch in this many equal parts
  # Adaptive depth: the core's pass count drawn per step from (seed, step) (train/depth.py,
  # sample_loops), one compiled train step per count drawn.
  loops_sampler: str = 'fixed'   # fixed (model.num_loops) | uniform | poisson_lognormal
  loops_low: int = 1             # sampled counts are clipped to [loops_low, loops_high]
  loops_high: int = 0            # 0: model.num_loops
  loops_mean: float = 0.0        # poisson_lognormal: Huginn's mean recurrence (the Poisson
                                 # rate's mean; a count's mean is loops_mean + 1 before the clip)
  backprop_loops: int = 0        # truncated backprop: gradient through the last min(k, r)
                                 # of a step's r passes (0: all passes)
  profile_steps: str = ''        # 'A:B': a jax.profiler trace of steps A..B-1 into RUN/profile
                                 # (train/profile.py; '' none)

  def __post_init__(self):
    if self.steps < 1:
      raise ValueError(f'train.steps={self.steps}: must be >= 1')
    if self.schedule not in SCHEDULES:
      raise ValueError(f'train.schedule={self.schedule!r}: must be one of {SCHEDULES}')
    if self.decay_shape not in DECAY_SHAPES:
      raise ValueError(f'train.decay_shape={self.decay_shape!r}: must be one of {DECAY_SHAPES}')
    if not 0.0 <= self.decay_fraction <= 1.0:
      raise ValueError(f'train.decay_fraction={self.decay_fraction}: must lie in [0, 1]')
    for name in ('log_every', 'eval_every', 'save_every', 'keep', 'routing_every',
                 'final_window', 'microbatches'):
      if getattr(self, name) < 1:
        raise ValueError(f'train.{name}={getattr(self, name)}: must be >= 1')
    checks = {'lr': (self.lr > 0, '> 0'), 'warmup': (self.warmup >= 0, '>= 0'),
              'clip': (self.clip >= 0, '>= 0 (0 disables clipping)'),
              'b1': (0 <= self.b1 < 1, 'in [0, 1)'), 'b2': (0 <= self.b2 < 1, 'in [0, 1)'),
              'eps': (self.eps > 0, '> 0'), 'weight_decay': (self.weight_decay >= 0, '>= 0'),
              'final_lr_fraction': (0 <= self.final_lr_fraction <= 1, 'in [0, 1]'),
              'lb_coef': (self.lb_coef >= 0, '>= 0'), 'z_coef': (self.z_coef >= 0, '>= 0'),
              'bias_rate': (self.bias_rate >= 0, '>= 0'),
              'save_every_minutes': (self.save_every_minutes >= 0, '>= 0 (0: off)'),
              'loops_high': (self.loops_high >= 0, '>= 0 (0: model.num_loops)'),
              'loops_mean': (self.loops_mean >= 0, '>= 0 (0 when unused; > 0 with '
                                                   'poisson_lognormal)'),
              'backprop_loops': (self.backprop_loops >= 0, '>= 0 (0: every pass)')}
    for name, (ok, want) in checks.items():
      value = getattr(self, name)
      if not (ok and math.isfinite(value)):  # NaN fails every comparison
        raise ValueError(f'train.{name}={value}: must be finite and {want}')
    if self.keep_every < 0:
      raise ValueError(f'train.keep_every={self.keep_every}: must be >= 0 (0: none)')
    self.kept_steps  # pylint: disable=pointless-statement  (validates train.keep_steps)
    self.profile_range  # pylint: disable=pointless-statement  (validates train.profile_steps)
    self._check_loops()
    if self.schedule_steps and self.schedule_steps < self.steps:
      raise ValueError(f'train.schedule_steps={self.schedule_steps} is shorter than '
                       f'train.steps={self.steps}')

  def _check_loops(self):
    """The sampler's keys against each other (their ranges are in __post_init__'s table); the
    checks against the model (untied attention, a per-pass
    router bias, the trained count) are experiment.check_adaptive_depth's."""
    if self.loops_sampler not in LOOPS_SAMPLERS:
      raise ValueError(f'train.loops_sampler={self.loops_sampler!r}: must be one of '
                       f'{LOOPS_SAMPLERS}')
    if self.loops_low < 1:
      raise ValueError(f'train.loops_low={self.loops_low}: must be >= 1 (a step runs at least '
                       'one pass); set --config.train.loops_low=1 or more')
    if self.loops_high and self.loops_low > self.loops_high:
      raise ValueError(f'train.loops_low={self.loops_low} exceeds train.loops_high='
                       f'{self.loops_high}: set loops_low <= loops_high')
    if self.loops_sampler == 'poisson_lognormal' and not self.loops_mean > 0:
      raise ValueError(f'train.loops_mean={self.loops_mean}: must be > 0 with '
                       "train.loops_sampler='poisson_lognormal' (Huginn's mean recurrence; "
                       'e.g. --config.train.loops_mean=4)')

  def loops_bounds(self, trained: int) -> tuple[int, int]:
    """[low, high] of the sampled pass counts (loops_high 0: `trained`, model.num_loops)."""
    return self.loops_low, self.loops_high or trained

  @property
  def sampled(self) -> bool:
    """Whether the pass count is drawn per step (train.loops_sampler other than 'fixed')."""
    return self.loops_sampler != 'fixed'

  @property
  def kept_steps(self) -> tuple[int, ...]:
    try:
      steps = tuple(int(v) for v in str(self.keep_steps).split(',') if v.strip())
    except ValueError:
      raise ValueError(f'train.keep_steps={self.keep_steps!r}: expected comma-separated step '
                       'numbers, e.g. 45000 or 1000,45000') from None
    if any(v < 1 for v in steps):
      raise ValueError(f'train.keep_steps={self.keep_steps!r}: steps must be >= 1')
    return steps

  @property
  def profile_range(self) -> tuple[int, int] | None:
    """train.profile_steps 'A:B' as (A, B), 1 <= A < B, B at most train.steps + 1 (a range
    past the last step ends with it); None when ''."""
    if not str(self.profile_steps).strip():
      return None
    try:
      a, b = (int(v) for v in str(self.profile_steps).split(':'))
    except ValueError:
      raise ValueError(f'train.profile_steps={self.profile_steps!r}: expected A:B, the steps '
                       'A..B-1 to trace, e.g. 20:25') from None
    if not 1 <= a < b:
      raise ValueError(f'train.profile_steps={self.profile_steps!r}: needs 1 <= A < B (steps '
                       'A..B-1 are traced)')
    if a > self.steps:
      raise ValueError(f'train.profile_steps={self.profile_steps!r} starts after the last step, '
                       f'train.steps={self.steps}')
    return a, min(b, self.steps + 1)

  @property
  def total_steps(self) -> int:
    return self.schedule_steps or self.steps

  @classmethod
  def from_dict(cls, d):
    return from_mapping(cls, d, 'train')
