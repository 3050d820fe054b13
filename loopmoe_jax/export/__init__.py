"""Checkpoints out of (and into) the stack: a plain safetensors file of the parameter tree
(safetensors_io.py) and the Hugging Face Mixtral layout with the loop unrolled (mixtral.py);
files.py reads workdirs and writes output directories atomically."""
