"""Per-token early exit from the looped core (model.exit: 'none' | 'kl' | 'gate').

A token stops looping once its exit rule fires after a pass; its state is frozen from then on
(later passes' updates are masked out for it, `jnp.where`), so the coda, the final norm and the
head read the state of its exit pass. When every token of the batch has exited, the remaining
passes are skipped (`nn.cond` inside the core's scan; a decode step runs its passes in a loop
that stops there, carrying the KV cache in place): at batch 1 (decoding one token) the time
of a step follows the passes that token actually runs.

What a pass "outputs" (`Readout`): the head applied to the final RMSNorm of the core's state
after that pass, skipping the coda (the cheapest faithful reading: one [D, V] matmul per pass;
with coda layers this is the distribution the model would give if the coda were the identity).
"Pass 0" is the core's input (the prelude's output), so a rule can fire after the first pass.

- 'kl' (no training; Huginn's zero-shot exit, Geiping et al. 2025, "Scaling up Test-Time
  Compute with Latent Reasoning"): after pass p (1-based) a token exits when
  KL(P_p || P_{p-1}) < model.exit_threshold (> 0), P_p the softmax of its pass-p readout.
- 'gate' (Ouro, Zhu et al. 2025, "Scaling Latent Reasoning via Looped Language Models"): a
  learned gate lambda_p = sigmoid(w . norm(h_p) + b) per pass (params 'exit_gate_w' [D],
  'exit_gate_b' [], top level of the model); the exit distribution over passes is
  p(t) = lambda_t prod_{j<t} (1 - lambda_j), the last pass taking the remaining mass
  (`exit_distribution`); training minimises sum_t p(t) L_t - exit_entropy * H(p)
  (`gate_objective`, wired in objective.gate_lm_loss: L_t the NLL of the output a token
  exiting after pass t gets, its core state through the coda, final norm and head,
  `pass_outputs`; lambda read from the normed core state as at inference; `gate_objective` is
  the objective alone); at inference a
  token exits once its cumulative exit probability sum_{j<=t} p(j) >= model.exit_threshold
  (in (0, 1]).

KV cache (decode.py): a pass a token skipped writes nothing to its slots; `fill_skipped` then
fills the slots of its skipped passes (at the positions of the step) with the K/V of its last
computed pass, so later tokens attending at a skipped pass read that pass's K/V. Inside one
step of several tokens (a prefill, the full forward) later tokens attending at a pass an
earlier token skipped read K/V computed from its frozen state instead (the pass runs, masked,
for the others).

The returned statistic: extras['exit'] = {'passes_BT': passes run per token (int32),
'mean_passes': their mean}.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from loopmoe_jax.core_plan import CoreInputs, CoreOutputs, CorePlan
from loopmoe_jax.layers import rms_norm
from pallas_kernels import decode_attention as decode_kernel

GATE_PARAMS = ('exit_gate_w', 'exit_gate_b')


class Readout(NamedTuple):
  """What the exit rules read, taken from the model's params: the final norm's gain [D] (or
  None), the head [D, V], and the gate's w [D] and b [] (or None)."""
  rule: str
  threshold: float
  eps: float
  gain_D: Any
  head_DV: Any
  gate_w_D: Any = None
  gate_b: Any = None


def has_gate(params) -> bool:
  p = params.get('params', params)
  return all(k in p for k in GATE_PARAMS)


def check_params(cfg, params) -> None:
  """model.exit='gate' needs a checkpoint trained with the gate (its params)."""
  if cfg.exit == 'gate' and not has_gate(params):
    raise ValueError("model.exit='gate': the params have no exit gate ('exit_gate_w', "
                     "'exit_gate_b'; the checkpoint was trained without model.exit='gate'): use "
                     "model.exit='kl' (no training needed) or 'none', or train with "
                     "model.exit='gate'")


def gate_params(module: nn.Module, d_model: int, param_dtype):
  """The gate's (w [D], b []) of `module` (the model), made at init (w zeros, b 0: lambda 0.5
  at every pass); at apply a missing gate is the ValueError of `check_params`."""
  if not (module.is_initializing() or module.has_variable('params', GATE_PARAMS[0])):
    check_params(module.cfg, {})
  w = module.param(GATE_PARAMS[0], nn.with_logical_partitioning(nn.initializers.zeros, ('embed',)),
                   (d_model,), param_dtype)
  b = module.param(GATE_PARAMS[1], nn.initializers.zeros, (), param_dtype)
  return w, b


def readout(module: nn.Module, embed_VD, gate, head_matrix) -> Readout:
  """The Readout of the model `module` from its trained params (final norm gain, head via
  model.head_matrix, the gate's (w, b) or None)."""
  c, p = module.cfg, module.variables['params']
  gain = nn.unbox(p['final_norm']['scale']) if c.norm_gain else None
  head = head_matrix(c, {'embed': embed_VD, 'head': None if c.tie_embeddings else
                         nn.unbox(p['head'])}, jnp.float32, runtime=module.runtime)
  w, b = gate if gate is not None else (None, None)
  return Readout(c.exit, c.exit_threshold, c.norm_eps, gain, head, w, b)


def pass_logprobs(r: Readout, x_BTD):
  """log P of a state: log_softmax(norm(x) @ head), float32 [B, T, V]."""
  return jax.nn.log_softmax(rms_norm(x_BTD, r.gain_D, r.eps) @ r.head_DV.astype(jnp.float32), -1)


def pass_lambda(r: Readout, x_BTD):
  """The gate's exit probability lambda [B, T] of a state."""
  h = rms_norm(x_BTD, r.gain_D, r.eps)
  return jax.nn.sigmoid(h @ r.gate_w_D.astype(jnp.float32) + r.gate_b.astype(jnp.float32))


def init_aux(r: Readout, x_BTD) -> dict:
  """The exit state carried through the passes, before pass 1."""
  bt = x_BTD.shape[:2]
  aux = {'exited': jnp.zeros(bt, bool), 'passes': jnp.zeros(bt, jnp.int32)}
  if r.rule == 'kl':
    aux['logp'] = pass_logprobs(r, x_BTD)
  else:
    aux['cdf'] = jnp.zeros(bt, jnp.float32)
    aux['survive'] = jnp.ones(bt, jnp.float32)
  return aux


def update(r: Readout, aux: dict, y_BTD) -> dict:
  """The exit state after a pass whose (masked) output is y_BTD."""
  live = ~aux['exited']
  out = dict(aux, passes=aux['passes'] + live.astype(jnp.int32))
  if r.rule == 'kl':
    logp = pass_logprobs(r, y_BTD)
    kl = jnp.sum(jnp.exp(logp) * (logp - aux['logp']), axis=-1)
    fire = kl < r.threshold
    out['logp'] = logp
  else:
    lam = pass_lambda(r, y_BTD)
    out['cdf'] = aux['cdf'] + lam * aux['survive']
    out['survive'] = aux['survive'] * (1.0 - lam)
    fire = out['cdf'] >= r.threshold
  out['exited'] = aux['exited'] | fire
  return out


def scan_core(scan_passes, stack: nn.Module, inputs: CoreInputs, readout: Readout,
              plan: CorePlan) -> CoreOutputs:
  """The core's passes with early exit: the state and the passes each token ran. `stack` is
  the core's Stack named 'body', run as the plain forward runs it (same params and per-pass
  cache): through `scan_passes` (core.Core's, a function of the step), each pass under a
  cond that skips it once every token has exited; or, decoding (`plan.carry_cache`), in a
  loop that stops there (`_decode_passes`)."""
  if plan.carry_cache:
    return _decode_passes(stack, inputs, readout, plan)
  x_BTD, *rest = inputs

  def step(mdl, carry, attn_l, e, positions, bias_l):
    x, aux = carry
    run = lambda m, h: m(h, attn_l, e, positions, bias_l)[0]
    y = nn.cond(jnp.all(aux['exited']), lambda m, h: h, run, mdl, x)
    y = jnp.where(aux['exited'][..., None], x, y)  # exited tokens keep their state
    return (y, update(readout, aux, y)), None

  (x_BTD, aux), _ = scan_passes(step)(stack, (x_BTD, init_aux(readout, x_BTD)), *rest)
  return CoreOutputs(x_BTD, {}, exit_passes_BT=aux['passes'])


def _decode_passes(stack: nn.Module, inputs: CoreInputs, readout: Readout,
                   plan: CorePlan) -> CoreOutputs:
  """Early exit while decoding: the passes in a loop that carries the KV cache whole, each
  pass writing its own slot in place (CorePlan.carry_cache), and stops once every token has
  exited; a cond per pass would copy the carried cache at each pass."""
  def body(mdl, carry):
    p, x, aux = carry
    one = inputs.one_pass(p, plan.per_pass)  # pass p's attention weights and bias
    y = mdl(x, one.pass_attn, one.e_BTD, one.positions_BT, one.bias, p)[0]
    y = jnp.where(aux['exited'][..., None], x, y)  # exited tokens keep their state
    return p + 1, y, update(readout, aux, y)

  def more(mdl, carry):
    return (carry[0] < plan.num_loops) & ~jnp.all(carry[2]['exited'])

  x_BTD = inputs.x_BTD
  _, x_BTD, aux = nn.while_loop(more, body, stack,
                                (jnp.zeros((), jnp.int32), x_BTD, init_aux(readout, x_BTD)),
                                carry_variables='cache')
  return CoreOutputs(x_BTD, {}, exit_passes_BT=aux['passes'])


def extras(passes_BT) -> dict:
  return {'passes_BT': passes_BT, 'mean_passes': jnp.mean(passes_BT.astype(jnp.float32))}


def fill_skipped(core_cache, passes_BT, start, tile: int = 0, minor: bool = False):
  """The core's per-pass cache (leaves [L, B, G, S, K]) with the slots of every pass a token
  skipped (pass index >= its passes run), at the step's positions [start, start + T), holding
  its last computed pass's K/V: the step's window of each leaf read and written back in place,
  pass by pass with selects. `start`: one position for every row, or one per row ([B]: row by
  row, in a loop). `tile`: the cache lies in tiles of this many slots (`minor`:
  slots-minor, [.., K, S]; the TPU decode kernels' layouts), so the window is the whole tiles
  around the step's slots (clamped at the cache's end; the whole cache where it is
  narrower), read and written where they lie (XLA:TPU copied the whole cache to another
  layout to read one slot, and to gather a row's)."""
  def leaf(x_LBGSK):
    x = jnp.swapaxes(x_LBGSK, 3, 4) if minor else x_LBGSK  # slots at axis 4 or 3
    if jnp.ndim(start) == 0:
      x = _fill_window(x, passes_BT, start, tile, minor)
    else:  # the loop carries the view: its layout is the cache's
      row = lambda b, x: _fill_window(x, passes_BT[b][None], start[b], tile, minor, b)
      x = jax.lax.fori_loop(0, x.shape[1], row, x)
    return jnp.swapaxes(x, 3, 4) if minor else x
  return jax.tree.map(leaf, core_cache)


def _fill_window(x, passes_BT, start, tile: int, minor: bool, row=None):
  """fill_skipped of one leaf `x` ([L, B, G, S, K], or `minor` [L, B, G, K, S]) at one start,
  for every row or for row `row` alone (passes_BT then its [1, T]): the window of slots,
  pass q's rows where skipped replaced by pass q - 1's (already filled), written back in
  place."""
  loops, b, g = x.shape[:3]
  slots, k = (x.shape[4], x.shape[3]) if minor else (x.shape[3], x.shape[4])
  t = passes_BT.shape[1]
  if tile:  # whole tiles of slots, the step's among them
    width = decode_kernel.window(t, slots, tile)
    at = decode_kernel.window_start(start, slots, width, tile)
  else:
    width, at = t, start
  token_W = at + jnp.arange(width) - start  # the step's token at each slot, or out of range
  in_step_W = (token_W >= 0) & (token_W < t)
  passes_BW = jnp.take(passes_BT, jnp.clip(token_W, 0, t - 1), axis=1)
  skipped = lambda q: jnp.expand_dims(in_step_W & (q >= passes_BW), (1, 2) if minor else (1, 3))
  rows = (0, b) if row is None else (row, 1)
  starts = (0, rows[0], 0) + ((0, at) if minor else (at, 0))
  win = jax.lax.dynamic_slice(x, starts, (loops, rows[1], g) + ((k, width) if minor
                                                                 else (width, k)))
  filled = [win[0]]
  for q in range(1, loops):
    filled.append(jnp.where(skipped(q), filled[-1], win[q]))
  return jax.lax.dynamic_update_slice(x, jnp.stack(filled), starts)


# The gate's training objective -----------------------------------------------------------------

def exit_distribution(lambda_LBT):
  """p(t) = lambda_t prod_{j<t} (1 - lambda_j) for t < L; the last pass takes the remaining
  mass prod_{j<L-1} (1 - lambda_j), so p sums to 1 over the passes. [L, B, T] float32."""
  lam = lambda_LBT.astype(jnp.float32)
  survive = jnp.cumprod(1.0 - lam, axis=0)
  before = jnp.concatenate([jnp.ones_like(survive[:1]), survive[:-1]], axis=0)
  p = lam * before
  return p.at[-1].set(before[-1])


def gate_objective(nll_LBT, lambda_LBT, entropy_coef: float, mask_BT=None):
  """Ouro's objective: the mean over tokens of sum_t p(t) nll_t - entropy_coef * H(p), with
  nll_LBT the per-pass NLL of each token's pass-t readout. Returns (objective, expected
  loss, entropy), each averaged over unmasked tokens (`gate_metrics`'s)."""
  obj, m = gate_metrics(nll_LBT, lambda_LBT, entropy_coef, mask_BT)
  return obj, m['loss'], m['exit_entropy']


# Gate training: the per-pass readouts of the training forward ----------------------------------

def pass_outputs(states_LBTD, final_BTD, coda, norm):
  """The final normed hidden state [L, B, T, D] the model outputs for a token that exits after
  pass t = 1..L: `coda` (a function of [N, T, D] states, or None without coda layers) then
  `norm` (the final RMSNorm) applied to each pass's core state; the last pass's is
  `final_BTD`, the plain forward's (its coda statistics are the forward's; the earlier passes'
  coda visits run as one batch of B x (L - 1) rows, batch-major so the batch axis keeps its
  sharding, and count in no aux loss; `coda` gets each sequence's rows together, the positions
  repeated to match: jnp.repeat(positions_BT, L - 1, axis=0)). This is what an
  exited token reads at inference (its frozen state goes through the coda), not the
  coda-less `pass_logprobs` the KL rule compares (the same without coda layers)."""
  n, b, t, d = states_LBTD.shape
  if n == 1:
    return final_BTD[None]
  early = jnp.swapaxes(states_LBTD[:-1], 0, 1).reshape(b * (n - 1), t, d)
  if coda is not None:
    early = coda(early)
  early = jnp.swapaxes(norm(early).reshape(b, n - 1, t, d), 0, 1)
  return jnp.concatenate([early, final_BTD[None].astype(early.dtype)], axis=0)


def gate_metrics(nll_LBT, lambda_LBT, entropy_coef: float, mask_BT=None):
  """(objective, metrics) of gate training: the objective is Ouro's, the mean over unmasked
  tokens of sum_t p(t) nll_t - entropy_coef * H(p) (p = `exit_distribution`, nll_LBT the
  per-pass NLL of each token's pass-t readout); the metrics 'loss' (the expected per-token
  NLL under p, what the objective trains without its entropy term), 'lm_loss_last' (the last
  pass's NLL: the plain model's loss), 'exit_entropy' (H(p)) and 'exit_mean_passes' (the
  expected exit pass, 1-based), each averaged over unmasked tokens."""
  p = exit_distribution(lambda_LBT)
  nll = nll_LBT.astype(jnp.float32)
  mask = (jnp.ones(nll.shape[1:], jnp.float32) if mask_BT is None
          else mask_BT.astype(jnp.float32))
  avg = lambda v: jnp.sum(v * mask) / jnp.maximum(jnp.sum(mask), 1.0)
  passes = jnp.arange(1, p.shape[0] + 1, dtype=jnp.float32)[:, None, None]
  loss = avg(jnp.sum(p * nll, axis=0))
  entropy = avg(-jnp.sum(p * jnp.log(jnp.maximum(p, 1e-30)), axis=0))
  return loss - entropy_coef * entropy, {
      'loss': loss, 'lm_loss_last': avg(nll[-1]), 'exit_entropy': entropy,
      'exit_mean_passes': jax.lax.stop_gradient(avg(jnp.sum(p * passes, axis=0)))}
