"""Test setup: 8 fake CPU devices, configured before any JAX computation."""
import jax

jax.config.update('jax_num_cpu_devices', 8)
jax.config.update('jax_platforms', 'cpu')
