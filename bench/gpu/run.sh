#!/usr/bin/env bash
# bench/gpu/run.sh: the GPU check of epx, one command on a machine with an NVIDIA GPU.
#
#   bench/gpu/run.sh            # build (nvcc, sm_90), run the CUDA tests, run the benchmarks
#   bench/gpu/run.sh --quick    # smaller benchmark shapes
#   bench/gpu/run.sh --build-only
#
# Builds every tests/cuda/*.cu and the three benchmarks of bench/gpu directly with nvcc, in
# parallel (no CMake, no Google Benchmark). Then runs the tests, all at once (separate
# processes sharing the GPU, 180 s each at most), then the benchmarks one after the other
# (alone on the GPU; 240, 240 and 120 s at most), all within EPX_GPU_DEADLINE (480 s):
# the kernels and the NCCL round trip at world size 1 (bench_kernels.cu); the layer's
# forward and forward+backward with 8 ranks on the one GPU at 4096 x 7168 and at the
# decode shape 128 x 7168, bf16, top-8, 256 experts (bench_layer_ep.cu); and the layout
# plan and the decode forward at world size 1 against the device time of their own
# kernels and copies (bench_decode.cu, through CUPTI where it is found). Every measurement is one JSON line
# (`validated`, microseconds; GB/s and the fraction of the device copy bandwidth where
# bytes move). Where python3 has torch with CUDA, the PyTorch bindings' CUDA extension
# builds meanwhile and their device cases run last (world size 1). A target that fails to build, or a test that fails, does not stop the
# others; the exit status is zero only if every target passed (a skip, without a device,
# counts as not passed), and the summary at the end says what.
#
# Logs, results.jsonl and summary.txt go to $EPX_GPU_BUILD (default build/gpu) and, where
# $OUT is set (the device tool's output folder), are copied there as well.
#
# Environment: EPX_CUDA_ARCH (default 90), EPX_GPU_BUILD, NVCC, DOCTEST_INCLUDE (a folder
# holding doctest/doctest.h; also looked for in .gpu-deps/, which bench/gpu/prepare.sh
# fills), NCCL_HOME (NCCL's prefix; otherwise the CUDA toolkit, /usr, /usr/local, then
# the nvidia-nccl Python package of python3 are searched), EPX_GPU_DEADLINE. CUPTI is
# looked for in the toolkit and in the nvidia-cuda-cupti Python package.
set -uo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$root" || exit 1

quick=""
build_only=0
for a in "$@"; do
  case "$a" in
    --quick) quick="--quick" ;;
    --build-only) build_only=1 ;;
    -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
    *) echo "run.sh: unknown argument '$a' (try --help)" >&2; exit 2 ;;
  esac
done

arch=${EPX_CUDA_ARCH:-90}
out=${EPX_GPU_BUILD:-build/gpu}
mkdir -p "$out"
start=$(date +%s)
say() { printf '\n==== %s (%ds) ====\n' "$*" $(( $(date +%s) - start )); }
die() { printf 'run.sh: error: %s\n' "$*" >&2; exit 1; }
have_timeout=$(command -v timeout || true)
limited() {  # limited SECONDS cmd...: run with a time limit when `timeout` exists
  local s=$1; shift
  if [[ -n "$have_timeout" ]]; then timeout --kill-after=10 "$s" "$@"; else "$@"; fi
}
# The whole run ends by EPX_GPU_DEADLINE seconds (default 480) after its start, summary
# included: each step's limit is cut to what is left (less 20 s for the summary), and a
# step with under 30 s left does not start.
deadline=${EPX_GPU_DEADLINE:-480}
left() {  # left STEP_LIMIT: the limit a step gets now (0: do not start it)
  local r=$(( deadline - ($(date +%s) - start) - 20 ))
  (( r > $1 )) && r=$1
  (( r < 30 )) && r=0
  echo "$r"
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
echo "cpus: $(nproc)"

cuda_home=$(cd "$(dirname "$nvcc")/.." && pwd)
inc=(-Iinclude -Itests)
lib=()

# NCCL: a folder holding include/nccl.h, and the library beside it in lib/ or lib64/ (the
# Python package ships only libnccl.so.2, hence -l: with the file's name).
nccl_prefixes=()
[[ -n "${NCCL_HOME:-}" ]] && nccl_prefixes+=("$NCCL_HOME")
nccl_prefixes+=("$cuda_home" /usr /usr/local)
if command -v python3 >/dev/null 2>&1; then
  py_nccl=$(python3 -c 'import nvidia.nccl as m, os; print(os.path.dirname(m.__file__) if m.__file__ else list(m.__path__)[0])' 2>/dev/null || true)
  [[ -n "$py_nccl" ]] && nccl_prefixes+=("$py_nccl")
fi
nccl_inc="" nccl_lib=""
for p in "${nccl_prefixes[@]}"; do
  [[ -f "$p/include/nccl.h" ]] || continue
  for d in "$p/lib" "$p/lib64" "$p/lib/x86_64-linux-gnu" /usr/lib/x86_64-linux-gnu; do
    for f in libnccl.so libnccl.so.2; do
      if [[ -e "$d/$f" ]]; then nccl_inc="$p/include"; nccl_lib="$d/$f"; break 3; fi
    done
  done
done
[[ -n "$nccl_lib" ]] || die "NCCL not found (nccl.h and libnccl.so[.2]; searched: ${nccl_prefixes[*]}; set NCCL_HOME)"
echo "nccl: $nccl_inc, $nccl_lib"
inc+=(-I"$nccl_inc")
lib+=(-L"$(dirname "$nccl_lib")" "-l:$(basename "$nccl_lib")" -Xlinker -rpath -Xlinker "$(dirname "$nccl_lib")")

# CUPTI, for the device time of bench_decode.cu (optional: without it that benchmark
# reports wall times only).
cupti=()
cupti_prefixes=("$cuda_home" "$cuda_home/extras/CUPTI")
if command -v python3 >/dev/null 2>&1; then
  # nvidia-cuda-cupti-cu12 installs nvidia/cuda_cupti, the CUDA 13 packages nvidia/cu13.
  py_nvidia=$(python3 -c 'import nvidia, os; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
  [[ -n "$py_nvidia" ]] && cupti_prefixes+=("$py_nvidia/cuda_cupti" "$py_nvidia/cu13")
fi
for p in "${cupti_prefixes[@]}"; do
  [[ -f "$p/include/cupti.h" ]] || continue
  for d in "$p/lib64" "$p/lib"; do
    for f in "$d"/libcupti.so "$d"/libcupti.so.[0-9]*; do
      if [[ -e "$f" ]]; then
        cupti=(-DEPX_BENCH_CUPTI=1 -I"$p/include" -L"$d" "-l:$(basename "$f")" -Xlinker -rpath -Xlinker "$d"); break 3
      fi
    done
  done
done
if [[ ${#cupti[@]} -gt 0 ]]; then echo "cupti: ${cupti[*]}"; else echo "cupti not found: bench_decode reports wall times only"; fi

# doctest, for the tests.
for d in "${DOCTEST_INCLUDE:-}" "$root/.gpu-deps"; do
  [[ -n "$d" && -f "$d/doctest/doctest.h" ]] && { inc+=(-I"$d"); break; }
done
doctest_ok=1
if ! printf '#include <doctest/doctest.h>\n' | "$nvcc" "${inc[@]}" -x c++ -E - >/dev/null 2>&1; then
  doctest_ok=0
  echo "doctest not found (run bench/gpu/prepare.sh where it is installed and carry .gpu-deps, or set DOCTEST_INCLUDE): the CUDA tests cannot be built"
fi
# NCCL's folder first in the run path, so that the NCCL found here is the one loaded.
flags=(-std=c++17 -O3 "-gencode=arch=compute_${arch},code=sm_${arch}" --extended-lambda --expt-relaxed-constexpr
       -Xcompiler=-Wall,-Wextra "${lib[@]}" -L"$cuda_home/lib64" -Xlinker -rpath -Xlinker "$cuda_home/lib64")

# The PyTorch bindings' CUDA layer (bindings/torch, docs/pytorch.md): where python3 has a
# torch that sees the GPU, its extension builds in the background (sm_${arch} only) while
# the targets below build, and its device cases run after the benchmarks, at world size 1
# (one GPU: NCCL needs a GPU per rank).
torch_build_pid=""
if [[ $build_only == 0 ]] && command -v python3 >/dev/null 2>&1 &&
   python3 -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  echo "torch: $(python3 -c 'import torch; print(torch.__version__, torch.version.cuda)')"
  export EPX_TORCH_CUDA=1 TORCH_CUDA_ARCH_LIST="${arch%?}.${arch: -1}" PYTHONPATH="$root/bindings/torch${PYTHONPATH:+:$PYTHONPATH}"
  ( limited "$(left 360)" nice -n 10 python3 -c 'import epx_torch' >"$out/torch_build.log" 2>&1 ) &
  torch_build_pid=$!
else
  echo "torch with CUDA not found in python3: the bindings' device cases do not run"
fi

say "build (nvcc, sm_${arch}) into $out"
targets=() sources=()
if [[ $doctest_ok == 1 ]]; then
  for src in tests/cuda/*.cu; do
    targets+=("test_cuda_$(basename "$src" .cu)"); sources+=("$src tests/cuda/support/device_main.cpp")
  done
fi
targets+=(epx_bench_gpu_kernels epx_bench_gpu_layer_ep epx_bench_gpu_decode)
sources+=(bench/gpu/bench_kernels.cu bench/gpu/bench_layer_ep.cu bench/gpu/bench_decode.cu)
pids=()
for i in "${!targets[@]}"; do
  extra=()
  [[ ${targets[$i]} == epx_bench_gpu_decode ]] && extra=(${cupti[@]+"${cupti[@]}"})
  # shellcheck disable=SC2086  # sources[i] is a list of paths without spaces
  ( limited "$(left 300)" "$nvcc" "${inc[@]}" ${sources[$i]} "${flags[@]}" ${extra[@]+"${extra[@]}"} \
      -o "$out/${targets[$i]}" >"$out/${targets[$i]}.build.log" 2>&1 ) &
  pids+=($!)
done
declare -A built result
for i in "${!pids[@]}"; do
  name=${targets[$i]}
  if wait "${pids[$i]}"; then
    built[$name]=1
    echo "built $name"
  else
    result[$name]="NOT BUILT (log: $out/$name.build.log)"
    echo "FAILED to build $name; log:"; cat "$out/$name.build.log"
  fi
done
[[ $doctest_ok == 1 ]] || result[tests]="NOT BUILT (doctest missing)"
echo "build took $(( $(date +%s) - start )) s"

copy_out() {  # the logs and results into $OUT, where the device tool returns them
  [[ -n "${OUT:-}" && -d "${OUT:-}" ]] || return 0
  cat "$out"/*.log > "$OUT/logs.txt" 2>/dev/null || true
  cp "$out/results.jsonl" "$out/summary.txt" "$OUT/" 2>/dev/null || true
}

if [[ $build_only == 0 ]]; then
  tlimit=$(left 180)
  say "tests (in parallel, ${tlimit} s each at most)"
  tpids=() tnames=()
  for name in "${targets[@]}"; do
    [[ $name == test_cuda_* && -n "${built[$name]:-}" ]] || continue
    if (( tlimit == 0 )); then result[$name]="NOT RUN (deadline)"; continue; fi
    ( limited "$tlimit" "$out/$name" --duration=true >"$out/$name.log" 2>&1 ) &
    tpids+=($!); tnames+=("$name")
  done
  for i in "${!tpids[@]}"; do
    name=${tnames[$i]} rc=0
    wait "${tpids[$i]}" || rc=$?
    say "test $name (exit $rc)"
    cat "$out/$name.log"
    skipped=$(grep -Eo '\| *[0-9]+ skipped' "$out/$name.log" | grep -Eo '[0-9]+' | head -1)
    note=""
    [[ ${skipped:-0} -gt 0 ]] && note=" ($skipped test case(s) skipped: see the log)"
    case $rc in
      0) result[$name]="passed$note" ;;
      77) result[$name]="SKIPPED (no usable CUDA device)" ;;
      124|137) result[$name]="FAILED (timed out after $tlimit s)" ;;
      *) result[$name]="FAILED (exit $rc)" ;;
    esac
  done

  : > "$out/results.jsonl"
  bench() {  # bench NAME LIMIT: one benchmark alone on the GPU
    local name=$1 limit rc=0
    limit=$(left "$2")
    say "benchmark $name"
    if [[ -z "${built[$name]:-}" ]]; then return; fi
    if (( limit == 0 )); then result[$name]="NOT RUN (deadline)"; return; fi
    limited "$limit" "$out/$name" $quick >"$out/$name.log" 2>&1 || rc=$?
    cat "$out/$name.log"
    grep -h '^JSON ' "$out/$name.log" | sed 's/^JSON //' >> "$out/results.jsonl" || true
    case $rc in
      0) result[$name]="ok" ;;
      77) result[$name]="SKIPPED (no usable CUDA device)" ;;
      124|137) result[$name]="FAILED (timed out after $limit s)" ;;
      *) result[$name]="FAILED (exit $rc)" ;;
    esac
  }
  bench epx_bench_gpu_kernels 240
  bench epx_bench_gpu_layer_ep 240
  bench epx_bench_gpu_decode 120

  # The bindings' device layer against the host layer (test_device.py), world size 1.
  name=torch_cuda_layer
  if [[ -z "$torch_build_pid" ]]; then
    result[$name]="SKIPPED (python3 has no torch with CUDA)"
  else
    rc=0
    wait "$torch_build_pid" || rc=$?
    say "$name (extension build exit $rc)"
    if (( rc != 0 )); then
      tail -n 40 "$out/torch_build.log"
      result[$name]="NOT BUILT (exit $rc, log: $out/torch_build.log)"
    else
      limit=$(left 150)
      if (( limit == 0 )); then
        result[$name]="NOT RUN (deadline)"
      else
        EPX_TORCH_TIMEOUT=120 limited "$limit" python3 -m torch.distributed.run --standalone --nproc-per-node=1 \
          bindings/torch/tests/run.py --no-ops --device cuda >"$out/$name.log" 2>&1 || rc=$?
        cat "$out/$name.log"
        case $rc in
          0) result[$name]="passed ($(grep -Eo 'RESULT passed=[0-9]+ failed=[0-9]+' "$out/$name.log" | tail -1))" ;;
          124|137) result[$name]="FAILED (timed out after $limit s)" ;;
          *) result[$name]="FAILED (exit $rc)" ;;
        esac
      fi
    fi
  fi
fi

say "summary"
status=0
for k in "${!result[@]}"; do
  case ${result[$k]} in passed*|ok) ;; *) status=1 ;; esac
done
{
  echo "built ${#built[@]} of ${#targets[@]} targets"
  for k in $(printf '%s\n' "${!result[@]}" | sort); do echo "$k: ${result[$k]}"; done
  if [[ $build_only == 0 ]]; then
    echo "results ($out/results.jsonl):"
    cat "$out/results.jsonl"
  fi
  echo "total time $(( $(date +%s) - start )) s, exit $status"
} | tee "$out/summary.txt"
copy_out
exit $status
