"""Rebuilds the task pack's JSONL from the embedded corpus: python -m loopmoe_jax.lm_tasks"""
from loopmoe_jax import lm_tasks

if __name__ == '__main__':
  print(lm_tasks.write_pack())
