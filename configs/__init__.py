"""The configs: `--config=configs/NAME.py[:ARG]` files (each docstring gives its command); also
shipped inside the installed package as loopmoe_jax.configs (setup.py)."""
