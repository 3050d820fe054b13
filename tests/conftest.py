"""Test setup: 8 fake CPU devices, configured before any JAX computation, and a persistent
compilation cache shared by the test workers (and the scripts the tests start), so a train
step that several tests compile alike is compiled once. The cache changes no result: a hit
loads the executable that compiling the same program gives."""
import os
import tempfile

os.environ.setdefault('JAX_COMPILATION_CACHE_DIR',
                      os.path.join(tempfile.gettempdir(), 'loopmoe_jax_test_xla_cache'))
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.2')
# a size bound turns on eviction, and with it the file lock that keeps a worker from reading
# an entry another one is still writing
os.environ.setdefault('JAX_COMPILATION_CACHE_MAX_SIZE', str(1 << 30))

# Tests compile many small programs and run each briefly: XLA:CPU's LLVM optimisation is most
# of their compile time and little of their run time, so the suite (and the scripts it
# starts, which inherit the environment) compiles without it. Results are the same programs'.
os.environ['XLA_FLAGS'] = ' '.join(filter(None, [
    os.environ.get('XLA_FLAGS', ''), '--xla_backend_optimization_level=0',
    '--xla_llvm_disable_expensive_passes=true']))

import jax  # pylint: disable=wrong-import-position

jax.config.update('jax_num_cpu_devices', 8)
jax.config.update('jax_platforms', 'cpu')
