#!/usr/bin/env bash
# GPU checks for pallas_kernels, in one call on a machine with a CUDA device:
#   1. the GPU-marked tests of tests/test_*kernel*.py and tests/test_attention_impls.py (compiled
#      kernels, the decode kernel and cuDNN attention vs references; H100/H200, A100, L4, RTX 4090), run without
#      tests/conftest.py (it pins jax_platforms=cpu);
#   2. `scripts/benchmark.py kernels`, which adds the gpu_* keys (tile tuning, Pallas vs
#      ragged_dot vs dense TFLOP/s at E 8/64, the MoE layer vs a dense SwiGLU, the Pallas
#      self-check and what dispatch 'auto' picks) to the CPU ones.
# Results land in $OUT (default ./gpu_check_out): pytest log + JUnit XML, benchmark JSON + log,
# and the device/jax versions. Exit status: non-zero if the tests or the benchmark failed.
# The default limits (tests 150 s, benchmark 330 s; TEST_TIMEOUT / BENCH_TIMEOUT) keep one call
# under 8 minutes; the benchmark prints its partial results as it goes.
#   usage: OUT=/some/dir bash scripts/gpu_check.sh [--quick]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_check_out}"
mkdir -p "$OUT"
PY="${PYTHON:-$(command -v python3 || command -v python)}"
QUICK="${1:-}"

"$PY" -c 'import jax; print(jax.__version__, jax.default_backend(), jax.devices())' \
  > "$OUT/devices.txt" 2>&1
cat "$OUT/devices.txt"

# Mosaic GPU kernels need Hopper (sm_90+): on an A100 (8.0), L4 or RTX 4090 (8.9) their tests
# are deselected and the Triton family runs (pallas_kernels/capability.py's MIN_CC decides;
# NO_MGPU is the compute capability when Mosaic GPU cannot run, empty otherwise)
NO_MGPU=$("$PY" -c 'from pallas_kernels import capability as c; cc = c.local_cc()
print("" if cc is None or cc >= c.MIN_CC["mgpu"] else "%d.%d" % cc)' 2>/dev/null | tail -n 1)
SELECT=()
if [ -n "$NO_MGPU" ]; then
  SELECT=(-k "not mgpu"); echo "compute capability $NO_MGPU: Mosaic GPU tests deselected"
fi

timeout "${TEST_TIMEOUT:-150}" "$PY" -m pytest -q --noconftest -m gpu "${SELECT[@]}" tests/test_*kernel*.py tests/test_attention_impls.py -rs -p no:cacheprovider \
  --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

PYTHONUNBUFFERED=1 timeout "${BENCH_TIMEOUT:-330}" "$PY" scripts/benchmark.py kernels $QUICK --json="$OUT/kernels.json" 2>&1 \
  | tee "$OUT/kernels.log"
bench_rc=${PIPESTATUS[0]}

echo "gpu tests rc=$tests_rc benchmark rc=$bench_rc" | tee "$OUT/summary.txt"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ]
