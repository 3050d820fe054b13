"""The training objective: LM loss plus weighted aux losses; the LM loss is reported alone.

The loss applies the output head itself (`token_nll`): with `run.loss_chunk` = c > 0 the
head, the log-softmax and the target's log-probability run over vocabulary chunks of at most c
columns (`chunked_nll_sum`, a custom VJP: an online log-sum-exp forward, a backward that
recomputes each chunk's logits), so at most [B, T, c] float32 logits exist at a time in the
forward or the backward, never [B, T, V]; with `run.remat` set the whole-vocabulary head and
loss are rematerialised (the backward keeps the final hidden states, not the logits).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from loopmoe_jax import early_exit
from loopmoe_jax.layers import DTYPES
from loopmoe_jax.model import head_matrix, variables


def token_nll_of_logits(logits_BTV, targets_BT):
  """Per-token negative log-likelihood (float32): logsumexp(logits) - the target's logit."""
  logits = logits_BTV.astype(jnp.float32)
  target = jnp.take_along_axis(logits, targets_BT[..., None], axis=-1)[..., 0]
  return jax.nn.logsumexp(logits, axis=-1) - target


def lm_loss(logits_BTV, targets_BT, mask_BT=None):
  """Mean next-token negative log-likelihood (float32) over unmasked positions."""
  nll_BT = token_nll_of_logits(logits_BTV, targets_BT)
  if mask_BT is None:
    return jnp.mean(nll_BT)
  mask = mask_BT.astype(jnp.float32)
  return jnp.sum(nll_BT * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def _nll_sum(h_BTD, head_DV, targets_BT, mask_BT):
  """Summed NLL with the whole [B, T, V] float32 logits."""
  logits = jnp.dot(h_BTD, head_DV.astype(h_BTD.dtype), preferred_element_type=jnp.float32)
  return jnp.sum(token_nll_of_logits(logits, targets_BT) * mask_BT)


def _vocab_chunks(vocab: int, chunk: int) -> tuple[int, int]:
  """(columns per chunk, chunks): the fewest chunks of at most `chunk` columns, as even as can
  be (a vocabulary that does not divide is padded; padded columns are masked out)."""
  n = -(-vocab // chunk)
  return -(-vocab // n), n


def _chunk_logits(h_BTD, padded_DV, vocab: int, i, cols: int):
  """float32 logits of vocabulary chunk i [B, T, cols] (-inf past the vocabulary), the chunk's
  first column and its head columns, from the head padded to whole chunks (padded once,
  outside the loop over chunks)."""
  start = i * cols
  w = jax.lax.dynamic_slice_in_dim(padded_DV, start, cols, axis=1)
  logits = jnp.dot(h_BTD, w.astype(h_BTD.dtype), preferred_element_type=jnp.float32)
  valid = start + jnp.arange(cols) < vocab
  return jnp.where(valid, logits, -jnp.inf), start, w


def _pad_cols(head_DV, cols: int):
  pad = -head_DV.shape[1] % cols
  return jnp.pad(head_DV, ((0, 0), (0, pad))) if pad else head_DV


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def chunked_nll_sum(h_BTD, head_DV, targets_BT, mask_BT, chunk: int):
  """Summed NLL of the head over vocabulary chunks of at most `chunk` columns: the forward
  keeps a running log-sum-exp per token; the backward recomputes each chunk's logits and
  writes that chunk's head gradient in place, so no [B, T, V] array and no per-chunk copy of
  the head's gradient exists (memory O(B x T x chunk) beyond the gradients)."""
  return _chunked_fwd(h_BTD, head_DV, targets_BT, mask_BT, chunk)[0]


def _chunked_fwd(h_BTD, head_DV, targets_BT, mask_BT, chunk):
  nll_BT, lse = _chunked_lse(h_BTD, head_DV, targets_BT, chunk)
  mask = mask_BT.astype(jnp.float32)
  return jnp.sum(nll_BT * mask), (h_BTD, head_DV, targets_BT, mask, lse)


def _chunked_lse(h_BTD, head_DV, targets_BT, chunk):
  """(per-token NLL, per-token log-sum-exp), [B, T] float32, over vocabulary chunks."""
  cols, n = _vocab_chunks(head_DV.shape[1], chunk)
  padded_DV = _pad_cols(head_DV, cols)

  def step(carry, i):
    m, l, tgt = carry
    logits, start, _ = _chunk_logits(h_BTD, padded_DV, head_DV.shape[1], i, cols)
    m_new = jnp.maximum(m, jnp.max(logits, axis=-1))
    l = l * jnp.exp(m - m_new) + jnp.sum(jnp.exp(logits - m_new[..., None]), axis=-1)
    here = (targets_BT >= start) & (targets_BT < start + cols)
    pick = jnp.take_along_axis(logits, jnp.clip(targets_BT - start, 0, cols - 1)[..., None],
                               axis=-1)[..., 0]
    return (m_new, l, jnp.where(here, pick, tgt)), None

  shape = targets_BT.shape
  init = (jnp.full(shape, -jnp.inf), jnp.zeros(shape, jnp.float32), jnp.zeros(shape, jnp.float32))
  (m, l, tgt), _ = jax.lax.scan(step, init, jnp.arange(n))
  lse = m + jnp.log(l)
  return lse - tgt, lse


def _chunked_bwd(chunk, res, g):
  h_BTD, head_DV, targets_BT, mask, lse = res
  cols, n = _vocab_chunks(head_DV.shape[1], chunk)
  coef_BT = g * mask
  padded_DV = _pad_cols(head_DV, cols)

  def step(carry, i):
    dh, dw = carry
    logits, start, w = _chunk_logits(h_BTD, padded_DV, head_DV.shape[1], i, cols)
    onehot = (targets_BT[..., None] - start) == jnp.arange(cols)
    d = ((jnp.exp(logits - lse[..., None]) - onehot) * coef_BT[..., None]).astype(h_BTD.dtype)
    dh = dh + jnp.einsum('btv,dv->btd', d, w.astype(d.dtype), preferred_element_type=jnp.float32)
    dw_chunk = jnp.einsum('btd,btv->dv', h_BTD, d, preferred_element_type=jnp.float32)
    return (dh, jax.lax.dynamic_update_slice_in_dim(dw, dw_chunk.astype(dw.dtype), start, 1)), None

  init = (jnp.zeros(h_BTD.shape, jnp.float32),
          jnp.zeros((head_DV.shape[0], n * cols), head_DV.dtype))
  (dh, dw), _ = jax.lax.scan(step, init, jnp.arange(n))
  return dh.astype(h_BTD.dtype), dw[:, :head_DV.shape[1]], None, None


chunked_nll_sum.defvjp(_chunked_fwd, _chunked_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def chunked_token_nll(h_BTD, head_DV, targets_BT, chunk: int):
  """Per-token NLL [B, T] (float32) of the head over vocabulary chunks (`chunked_nll_sum`'s
  forward and backward, the cotangent per token instead of one scalar)."""
  return _chunked_token_fwd(h_BTD, head_DV, targets_BT, chunk)[0]


def _chunked_token_fwd(h_BTD, head_DV, targets_BT, chunk):
  nll_BT, lse = _chunked_lse(h_BTD, head_DV, targets_BT, chunk)
  return nll_BT, (h_BTD, head_DV, targets_BT, jnp.ones(targets_BT.shape, jnp.float32), lse)


def _chunked_token_bwd(chunk, res, g_BT):
  dh, dw, _, _ = _chunked_bwd(chunk, res, g_BT)
  return dh, dw, None


chunked_token_nll.defvjp(_chunked_token_fwd, _chunked_token_bwd)


def _token_nll_whole(h_BTD, head_DV, targets_BT):
  logits = jnp.dot(h_BTD, head_DV.astype(h_BTD.dtype), preferred_element_type=jnp.float32)
  return token_nll_of_logits(logits, targets_BT)


def head_token_nll(h_BTD, head_DV, targets_BT, chunk: int, remat: bool = False):
  """Per-token NLL [B, T] (float32) of the head on hidden states, as `head_nll` runs it
  (vocabulary chunks with `chunk`, else the whole logits, rematerialised with `remat`)."""
  if chunk and chunk < head_DV.shape[1]:
    return chunked_token_nll(h_BTD, head_DV, targets_BT, chunk)
  fn = jax.checkpoint(_token_nll_whole) if remat else _token_nll_whole
  return fn(h_BTD, head_DV, targets_BT)


def head_nll(h_BTD, head_DV, targets_BT, mask_BT, chunk: int, remat: bool = False):
  """(summed NLL, token count) of the output head `head_DV` [D, V] (any dtype; the matmuls run
  in the hidden states' dtype with float32 results) on the final hidden states: with `chunk`
  > 0 over vocabulary chunks of at most that many columns (`chunked_nll_sum`); else with the
  whole logits (rematerialised with `remat`: the backward keeps the hidden states)."""
  mask_BT = (jnp.ones(targets_BT.shape, jnp.float32) if mask_BT is None
             else mask_BT.astype(jnp.float32))
  count = jnp.sum(mask_BT)
  if chunk and chunk < head_DV.shape[1]:
    return chunked_nll_sum(h_BTD, head_DV, targets_BT, mask_BT, chunk), count
  fn = jax.checkpoint(_nll_sum) if remat else _nll_sum
  return fn(h_BTD, head_DV, targets_BT, mask_BT), count


def token_nll(params, model, batch, num_loops: int | None = None, router_bias=None,
              backprop_loops: int = 0):
  """(summed NLL over the batch's unmasked targets, their count, the model's extras), the head
  and loss as run.loss_chunk and run.remat say; `backprop_loops` > 0: gradient through the
  core's last that many passes only (truncated backprop, core.Core)."""
  run = model.runtime.run
  h_BTD, extras = model.apply(variables(params, router_bias=router_bias), batch['inputs'],
                              num_loops=num_loops, backprop_loops=backprop_loops,
                              method='hidden')
  head_DV = _head(model, params)
  total, count = head_nll(h_BTD, head_DV, batch['targets'], batch.get('mask'),
                          run.loss_chunk, remat=run.remat != 'none')
  return total, count, extras


def _head(model, params):
  """The head [D, V] as the loss applies it: in the parameters' dtype (the chunked loss casts
  chunk by chunk, and its head gradient stays in that dtype), gathered whole over its width
  on the model's mesh (a parameter gather: the hidden states stay where they are)."""
  c = model.cfg
  head_DV = head_matrix(c, variables(params)['params'], DTYPES[c.param_dtype],
                        runtime=model.runtime)
  return model.runtime.constrain(head_DV, (None, 'vocab'))


def gate_lm_loss(params, model, batch, num_loops: int | None = None, router_bias=None,
                 backprop_loops: int = 0):
  """Gate training's LM term (model.exit='gate'; Ouro, Zhu et al. 2025): the per-token NLL of
  the output a token exiting after each pass t = 1..L would give (early_exit.pass_outputs: its core
  state through the coda, the final norm and the head), combined under the gate's exit
  distribution as early_exit.gate_metrics computes it (expected NLL - model.exit_entropy x entropy,
  mean over unmasked tokens). Returns (objective, metrics of early_exit.gate_metrics, the model's
  extras). The head and loss run one pass at a time (`jax.lax.map` over the passes: one pass's
  logits live at once, the batch axis keeps its sharding) as run.loss_chunk and run.remat say
  (`head_token_nll`)."""
  c, run = model.cfg, model.runtime.run
  out, extras = model.apply(variables(params, router_bias=router_bias), batch['inputs'],
                            num_loops=num_loops, backprop_loops=backprop_loops,
                            method='gate_outputs')  # backprop_loops > 0 is refused (core.Core)
  h_LBTD, lam_LBT = out.hidden_LBTD, out.lambda_LBT
  head_DV = _head(model, params)
  nll_LBT = jax.lax.map(lambda h_BTD: head_token_nll(h_BTD, head_DV, batch['targets'],
                                                     run.loss_chunk, remat=run.remat != 'none'),
                        h_LBTD)
  obj, metrics = early_exit.gate_metrics(nll_LBT, lam_LBT, c.exit_entropy, batch.get('mask'))
  return obj, metrics, extras


def loss_fn(params, model, batch, lb_coef: float = 0.01, z_coef: float = 0.001,
            num_loops: int | None = None, router_bias=None, backprop_loops: int = 0):
  """Returns (total objective, metrics). batch: 'inputs', 'targets' [B, T], optional 'mask'.
  With `router_bias` (model.router_bias; not differentiated) the metrics also hold the expert
  loads per segment under 'load' ({segment: [D, E] or the core's [L, D, E]}).
  With model.exit='gate' the LM term is `gate_lm_loss`'s objective; 'loss' is then the
  expected NLL under the exit distribution, and the metrics add 'lm_loss_last' (the plain
  model's loss, the last pass's), 'exit_entropy' and 'exit_mean_passes'.
  `backprop_loops` > 0: truncated backprop (token_nll; refused with the gate, which trains
  every pass's readout)."""
  if router_bias is not None:
    router_bias = jax.lax.stop_gradient(router_bias)
  if model.cfg.exit == 'gate':
    lm_term, gate, extras = gate_lm_loss(params, model, batch, num_loops, router_bias,
                                         backprop_loops)
  else:
    total_nll, count, extras = token_nll(params, model, batch, num_loops, router_bias,
                                         backprop_loops)
    lm_term = total_nll / jnp.maximum(count, 1.0)
    gate = {'loss': lm_term}
  total = lm_term + lb_coef * extras['load_balance'] + z_coef * extras['z_loss']
  metrics = {**gate, 'load_balance': extras['load_balance'], 'z_loss': extras['z_loss'],
             'objective': total, 'dropped': extras['dropped'].astype(jnp.float32)}
  if router_bias is not None:
    metrics['load'] = {seg: s['load'] for seg, s in extras['per_visit'].items()}
  return total, metrics
