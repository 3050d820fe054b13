"""Scaling laws for looped MoE models: forms, fitting, design and three-budget matching.

    from loopmoe_jax import scaling
    res = scaling.fit('chinchilla', {'N': ..., 'D': ..., 'loss': ...})
    res.params, res.rmse

Modules: forms (law forms, the expert expansion), mappings (the loop laws' N_eff mappings), fitting (Huber/L-BFGS fit,
bootstrap, held-out RMSE, comparison table, ranking with paired intervals), design (compute-/memory-optimal and joint
choices, the effective-parameter multiplier, IsoFLOP curves, compute efficiency), matching
(SMELT's FLOPs/params/KV matching), smelt_analysis (SMELT's frontier exponent, optimum, tokens
per parameter and compute efficiency with cell-bootstrap intervals), sweep (grids of runs from
configs), data (CSV loaders), synthetic (data from known laws), plots (PNG figures).
"""
from loopmoe_jax.scaling.data import chinchilla_epoch, read_csv, write_csv
from loopmoe_jax.scaling.design import (chinchilla_optimal, compute_efficiency,
                                        compute_for_loss, frontier_loss, isoflop,
                                        joint_optimum, memory_optimal_experts, multiplier,
                                        multiplier_asymptote, optimal_passes)
from loopmoe_jax.scaling.fitting import (Fit, as_columns, bootstrap, check_identified,
                                         compare, fit, format_table, free_parameters,
                                         from_params, heldout_predictions, heldout_rmse, rank)
from loopmoe_jax.scaling.forms import (FORMS, MAPPINGS, Form, expansion, get_form,
                                       register_mapping)
from loopmoe_jax.scaling import plots
