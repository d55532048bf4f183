#!/usr/bin/env bash
# bench/gpu/run.sh: the GPU check of epx, one command on a machine with an NVIDIA GPU.
#
#   bench/gpu/run.sh            # build (nvcc, sm_90), run the CUDA tests, run the benchmarks
#   bench/gpu/run.sh --quick    # smaller benchmark shapes
#
# Every measurement is also one JSON line (`validated`, microseconds, GB/s and the fraction
# of the device copy bandwidth), collected in $EPX_GPU_BUILD/results.jsonl and printed at
# the end: the kernels and the NCCL round trip at world size 1 (bench_kernels.cu), and the
# layer's forward and forward+backward with 8 ranks on the one GPU at 4096 x 7168 and at the
# decode shape 128 x 7168, bf16, top-8, 256 experts (bench_layer_ep.cu).
# Environment: EPX_CUDA_ARCH (default 90), EPX_GPU_BUILD (default build/gpu), NVCC,
# DOCTEST_INCLUDE (folder holding doctest/doctest.h), NCCL_HOME (NCCL's prefix if not in
# the CUDA toolkit or /usr). Needs nvcc, NCCL and, for the tests, doctest. Prints the
# benchmark table (bench/gpu/bench_kernels.cu explains the columns) and a summary; exits
# non-zero if a build, a test or a benchmark failed. Builds eight CUDA translation units
# directly with nvcc (no CMake, no Google Benchmark needed): a few minutes at most.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root"

quick=""
for a in "$@"; do
  case "$a" in
    --quick) quick="--quick" ;;
    -h|--help) sed -n '2,19p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$a' (try --help)" >&2; exit 2 ;;
  esac
done

arch=${EPX_CUDA_ARCH:-90}
out=${EPX_GPU_BUILD:-build/gpu}
mkdir -p "$out"
say() { printf '\n==== %s ====\n' "$*"; }
die() { printf 'run.sh: error: %s\n' "$*" >&2; exit 1; }
have_timeout=$(command -v timeout || true)
limited() {  # limited SECONDS cmd...: run with a time limit when `timeout` exists
  local s=$1; shift
  if [[ -n "$have_timeout" ]]; then timeout --kill-after=10 "$s" "$@"; else "$@"; fi
}

say "environment"
nvcc=${NVCC:-$(command -v nvcc || true)}
[[ -z "$nvcc" && -x /usr/local/cuda/bin/nvcc ]] && nvcc=/usr/local/cuda/bin/nvcc
[[ -n "$nvcc" ]] || die "nvcc not found (set NVCC or put the CUDA toolkit's bin/ on PATH)"
"$nvcc" --version | tail -n 2
if command -v nvidia-smi >/dev/null 2>&1; then
  nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
else
  echo "nvidia-smi not found: the tests will say whether a device is usable"
fi

cuda_home=$(cd "$(dirname "$nvcc")/.." && pwd)
inc=(-Iinclude -Itests)
lib=()
if [[ -n "${NCCL_HOME:-}" ]]; then
  inc+=(-I"$NCCL_HOME/include")
  for d in "$NCCL_HOME/lib" "$NCCL_HOME/lib64"; do lib+=(-L"$d" -Xlinker -rpath -Xlinker "$d"); done
fi
if ! printf '#include <nccl.h>\nint main(){return 0;}\n' | "$nvcc" "${inc[@]}" -x cu -E - >/dev/null 2>&1; then
  die "nccl.h not found (install NCCL or set NCCL_HOME)"
fi
doctest_ok=1
if [[ -n "${DOCTEST_INCLUDE:-}" ]]; then inc+=(-I"$DOCTEST_INCLUDE"); fi
if ! printf '#include <doctest/doctest.h>\n' | "$nvcc" "${inc[@]}" -x c++ -E - >/dev/null 2>&1; then
  doctest_ok=0
  echo "doctest not found (set DOCTEST_INCLUDE): the CUDA tests cannot be built"
fi
flags=(-std=c++17 -O3 "-gencode=arch=compute_${arch},code=sm_${arch}" --extended-lambda --expt-relaxed-constexpr
       -Xcompiler=-Wall,-Wextra -L"$cuda_home/lib64" -Xlinker -rpath -Xlinker "$cuda_home/lib64"
       ${lib[@]+"${lib[@]}"} -lnccl)

say "build (nvcc, sm_${arch}) into $out"
start=$(date +%s)
pids=()
names=()
build() {  # build NAME SOURCES...
  local name=$1; shift
  ( "$nvcc" "${inc[@]}" "$@" "${flags[@]}" -o "$out/$name" >"$out/$name.build.log" 2>&1 ) &
  pids+=($!); names+=("$name")
}
if [[ $doctest_ok == 1 ]]; then
  build test_cuda_exec tests/cuda/exec.cu tests/cuda/support/device_main.cpp
  build test_cuda_nccl tests/cuda/nccl.cu tests/cuda/support/device_main.cpp
  build test_cuda_layer tests/cuda/layer.cu tests/cuda/support/device_main.cpp
  build test_cuda_fp8 tests/cuda/fp8.cu tests/cuda/support/device_main.cpp
  build test_cuda_limits tests/cuda/limits.cu tests/cuda/support/device_main.cpp
  build test_cuda_threads_device tests/cuda/threads_device.cu tests/cuda/support/device_main.cpp
fi
build epx_bench_gpu_kernels bench/gpu/bench_kernels.cu
build epx_bench_gpu_layer_ep bench/gpu/bench_layer_ep.cu
build_failed=0
for i in "${!pids[@]}"; do
  if wait "${pids[$i]}"; then
    echo "built ${names[$i]}"
  else
    build_failed=1
    echo "FAILED to build ${names[$i]}; log:"; cat "$out/${names[$i]}.build.log"
  fi
done
echo "build took $(( $(date +%s) - start )) s"
[[ $build_failed == 0 ]] || die "build failed"

declare -A result
run_test() {  # run_test NAME: 0 passed, 77 skipped (no device), else failed
  local name=$1 rc=0
  say "test $name"
  limited 240 "$out/$name" --duration=true || rc=$?
  case $rc in
    0) result[$name]="passed" ;;
    77) result[$name]="SKIPPED (no usable CUDA device)" ;;
    124|137) result[$name]="FAILED (timed out after 240 s)" ;;
    *) result[$name]="FAILED (exit $rc)" ;;
  esac
}
if [[ $doctest_ok == 1 ]]; then
  run_test test_cuda_exec
  run_test test_cuda_nccl
  run_test test_cuda_layer
  run_test test_cuda_fp8
  run_test test_cuda_limits
  run_test test_cuda_threads_device
else
  result[tests]="NOT BUILT (doctest missing)"
fi

say "benchmark: kernels and NCCL at world size 1"
bench_rc=0
limited 300 "$out/epx_bench_gpu_kernels" $quick | tee "$out/bench.txt" || bench_rc=${PIPESTATUS[0]}
say "benchmark: the layer, 8 ranks on one GPU"
layer_rc=0
limited 240 "$out/epx_bench_gpu_layer_ep" $quick | tee "$out/bench_layer_ep.txt" || layer_rc=${PIPESTATUS[0]}
grep -h '^JSON ' "$out/bench.txt" "$out/bench_layer_ep.txt" | sed 's/^JSON //' > "$out/results.jsonl" || true

say "summary"
status=0
for k in "${!result[@]}"; do
  echo "$k: ${result[$k]}"
  [[ ${result[$k]} == passed ]] || status=1
done
if [[ $bench_rc == 0 ]]; then
  echo "benchmark kernels: ok (table above, also in $out/bench.txt)"
else
  echo "benchmark kernels: FAILED (exit $bench_rc)"; status=1
fi
if [[ $layer_rc == 0 ]]; then
  echo "benchmark layer (8 ranks, one GPU): ok"
else
  echo "benchmark layer (8 ranks, one GPU): FAILED (exit $layer_rc)"; status=1
fi
say "results ($out/results.jsonl)"
cat "$out/results.jsonl"
echo "total time $(( $(date +%s) - start )) s"
exit $status
