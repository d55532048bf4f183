#!/usr/bin/env bash
# Builds and runs the main example on the embedded threads backend (no MPI, no GPU).
# Installs the build tools first if they are missing. Arguments replace the defaults.
#
#   scripts/run-example.sh
#   scripts/run-example.sh --tp 4 --fsdp 2 --ep 4 --experts 8 --top-k 1
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

# The MoE training example when it is part of the tree, else the mesh tool with the
# seed's picture (spec section 1).
if [ -f examples/moe_training.cpp ]; then
  target=epx-moe-example
  default_args=()
else
  target=epx-mesh
  default_args=(--tp 2 --fsdp 4 --experts 8 --ep 2,4,8)
fi
build=${EPX_EXAMPLE_BUILD_DIR:-build/example}

scripts/install-deps.sh --build
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=Release -DEPX_BUILD_EXAMPLES=ON \
  -DEPX_BUILD_TESTS=OFF -DEPX_BUILD_BENCHMARKS=OFF -DEPX_ENABLE_CUDA=OFF -DEPX_ENABLE_MPI=OFF >/dev/null
cmake --build "$build" --target "$target" -j "${EPX_JOBS:-2}"

if [ $# -gt 0 ]; then args=("$@"); else args=("${default_args[@]}"); fi
echo "+ $build/examples/$target ${args[*]}"
exec "$build/examples/$target" "${args[@]}"
