"""Scaling laws for looped MoE models: forms, fitting, design and three-budget matching.

    from loopmoe_jax import scaling
    res = scaling.fit('chinchilla', {'N': ..., 'D': ..., 'loss': ...})
    res.params, res.rmse

Modules: forms (law forms, N_eff mappings), fitting (Huber/L-BFGS fit, bootstrap, held-out
RMSE, comparison table), design (compute-/memory-optimal choices, compute efficiency),
matching (SMELT's FLOPs/params/KV matching), smelt_analysis (SMELT's frontier exponent,
optimum, tokens per parameter and compute efficiency with cell-bootstrap intervals), sweep (grids of runs from configs), data (CSV
loaders), synthetic (data from known laws), plots (PNG figures).
"""
from loopmoe_jax.scaling.data import chinchilla_epoch, read_csv, write_csv
from loopmoe_jax.scaling.design import (chinchilla_optimal, compute_efficiency,
                                        compute_for_loss, frontier_loss,
                                        memory_optimal_experts, optimal_passes)
from loopmoe_jax.scaling.fitting import (Fit, as_columns, bootstrap, compare, fit,
                                         format_table, from_params, heldout_rmse)
from loopmoe_jax.scaling.forms import FORMS, MAPPINGS, Form, get_form, register_mapping
from loopmoe_jax.scaling import plots
