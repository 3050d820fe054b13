"""Analysis toolkit: routing diagnostics, mechanistic probes, evaluations, paired comparisons."""
