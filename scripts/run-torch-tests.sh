#!/usr/bin/env bash
# The PyTorch bindings' tests (bindings/torch, docs/pytorch.md):
#   1. a virtual environment in ${EPX_TORCH_VENV:-$HOME/.cache/epx/torch-venv}, made and filled
#      with the pinned packages of bindings/torch/requirements.txt (pip install --no-deps),
#      reused while the list is unchanged; a failed install fails this script;
#   2. the extension built (or found built) by importing epx_torch;
#   3. the tests under torchrun (gloo, CPU) with 2, 4 and 8 processes: the ops suite and the
#      emulated device layer against the host layer on each, the docs example on 4, the
#      transformers comparison and the benchmark on 8; then exit_clean.py on 8, a job that
#      ends with destroy_process_group and the interpreter's exit (exit status 0, no abort);
#   4. with nvcc, the CUDA build of the extension (EPX_TORCH_CUDA=1: compiled and imported;
#      its layer runs only where torch sees GPUs: run.py --device cuda).
# Prints every case as `torch[np=N] PASS|FAIL name` and ends with `N passed, N failed`; exits
# non-zero on any failure. EPX_TORCH_RUN_TIMEOUT (seconds, default 900) bounds each torchrun;
# EPX_TORCH_TIMEOUT (seconds, default 300) is the process group's timeout, after which a
# collective that waits for a rank fails.
#
# Runs of this script at the same time (from one copy of the repository or several) do not
# meet: each torchrun rendezvous on a port the system picks (--standalone: the agent's store
# listens on port 0 and its workers use that store); shared-memory names carry the process id
# and a random token; each copy of the repository builds the extension into its own directory
# (epx_torch/_build.py); the virtual environment is installed under an exclusive lock and used
# under a shared one, so an install waits (EPX_TORCH_LOCK_TIMEOUT seconds, default 1800) for
# the runs that use the old one and a run never sees a half-installed one.
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"

venv=${EPX_TORCH_VENV:-$HOME/.cache/epx/torch-venv}
req=bindings/torch/requirements.txt
python=${EPX_PYTHON:-python3}
stamp="$venv/.epx-requirements"
want=$(sha256sum "$req" | cut -d' ' -f1)

fail() {
  echo "torch: $*" >&2
  echo "0 passed, 1 failed"
  exit 1
}

# torch's CUDA libraries come from the toolkit (requirements.txt): make sure the loader sees it.
for d in /usr/local/cuda/lib64 /usr/local/cuda/lib; do
  [ -d "$d" ] && export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
done

mkdir -p "$(dirname "$venv")" || fail "cannot create the directory of $venv"
lock_wait=${EPX_TORCH_LOCK_TIMEOUT:-1800}
exec 9>"$venv.lock" || fail "cannot open the lock file $venv.lock"
installed() { [ -x "$venv/bin/python" ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; }
# Readers share the lock; an install takes it alone (then looks again: another run may have
# installed meanwhile) and goes back to sharing it.
flock -s -w "$lock_wait" 9 || fail "waited more than ${lock_wait}s for the lock $venv.lock (another run installing)"
if ! installed; then
  flock -x -w "$lock_wait" 9 ||
    fail "waited more than ${lock_wait}s for the lock $venv.lock (other runs using or installing it)"
  if ! installed; then
    echo "==== torch: installing the pinned packages into $venv ===="
    rm -rf "$venv"
    "$python" -m venv "$venv" 9>&- || fail "could not create the virtual environment $venv with $python"
    timeout "${EPX_TORCH_INSTALL_TIMEOUT:-1200}" "$venv/bin/python" -m pip install --no-deps \
      --disable-pip-version-check --no-input -q -r "$req" 9>&- ||
      fail "installing $req into $venv failed (see pip's message above)"
    echo "$want" >"$stamp"
  fi
  # From here on the environment is only read: share it with other runs.
  flock -s -w "$lock_wait" 9 || fail "could not take the shared lock $venv.lock"
fi
"$venv/bin/python" - 9>&- <<'EOF' || fail "the installed torch/transformers do not import (see above)"
import torch, transformers, accelerate, torch.distributed as dist
assert torch.__version__.split("+")[0] == "2.15.0", torch.__version__
assert transformers.__version__ == "5.23.0", transformers.__version__
assert dist.is_available() and dist.is_gloo_available(), "torch.distributed with gloo is missing"
print(f"torch {torch.__version__}, transformers {transformers.__version__}")
EOF

export PYTHONPATH="$root/bindings/torch${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 TRANSFORMERS_VERBOSITY=error
export EPX_TORCH_TIMEOUT=${EPX_TORCH_TIMEOUT:-300}
# The workers use the agent's store, which listens on the port the system gave it (never a
# fixed one such as 29500); none of a caller's rendezvous settings leak in.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=0
unset MASTER_ADDR MASTER_PORT RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK TORCHELASTIC_RUN_ID
echo "==== torch: building the extension ===="
t0=$(date +%s)
"$venv/bin/python" -c "import epx_torch" 9>&- || fail "building the epx_torch extension failed (see the compiler's message above)"
echo "extension ready in $(( $(date +%s) - t0 ))s"

passed=0
failed=0
noise='^\[rank[0-9]+\]:W[0-9]{4} |^W[0-9]{4} |^\*{10}|OMP_NUM_THREADS|^Writing model shards'
for np in 2 4 8; do
  extra=(--device emulated)
  [ "$np" = 4 ] && extra+=(--doc)
  [ "$np" = 8 ] && extra+=(--transformers --bench)
  echo "==== torch: torchrun --nproc-per-node=$np ${extra[*]} ===="
  log=$(mktemp)
  t0=$(date +%s)
  # Not under nice: with other work on the machine, niced ranks got a few percent of a core
  # each and a torchrun of 8 ranks did not get through its imports in 10 minutes.
  timeout --kill-after=30 "${EPX_TORCH_RUN_TIMEOUT:-900}" "$venv/bin/torchrun" --standalone --nproc-per-node="$np" \
    bindings/torch/tests/run.py "${extra[@]}" >"$log" 2>&1 9>&-
  rc=$?
  grep -Ev "$noise" "$log" | grep -E '^torch\[|^  ' || true
  line=$(grep -E '^torch\[np=[0-9]+\] RESULT passed=[0-9]+ failed=[0-9]+$' "$log" | tail -1)
  if [ -n "$line" ]; then
    p=$(sed -E 's/.*passed=([0-9]+).*/\1/' <<<"$line")
    f=$(sed -E 's/.*failed=([0-9]+).*/\1/' <<<"$line")
  else
    p=0
    f=0
  fi
  passed=$((passed + p))
  failed=$((failed + f))
  if [ "$rc" -ne 0 ] && [ "$f" -eq 0 ]; then
    # The run died (or timed out, rc 124) outside a case: count it, and show why.
    failed=$((failed + 1))
    echo "torch[np=$np] FAIL the torchrun itself exited with $rc; the end of its output:"
    grep -Ev "$noise" "$log" | tail -40
  fi
  echo "torch[np=$np] done in $(( $(date +%s) - t0 ))s (rc=$rc)"
  rm -f "$log"
done
# A job that ends as users end one: destroy_process_group with a layer alive, then the
# interpreter's own exit (run.py's harness skips it with os._exit). Every rank must exit
# with 0, and no process may abort in the teardown.
echo "==== torch: torchrun --nproc-per-node=8 exit_clean.py ===="
log=$(mktemp)
t0=$(date +%s)
timeout --kill-after=30 "${EPX_TORCH_RUN_TIMEOUT:-900}" "$venv/bin/torchrun" --standalone --nproc-per-node=8 \
  bindings/torch/tests/exit_clean.py >"$log" 2>&1 9>&-
rc=$?
name="a job that destroys its process groups with a layer alive and exits normally"
if [ "$rc" -eq 0 ] && grep -q '^exit_clean: every rank reached the end$' "$log" &&
  ! grep -q 'terminate called' "$log"; then
  passed=$((passed + 1))
  echo "torch[np=8] PASS $name ($(( $(date +%s) - t0 ))s)"
else
  failed=$((failed + 1))
  echo "torch[np=8] FAIL $name: torchrun exited with $rc; the end of its output:"
  grep -Ev "$noise" "$log" | tail -40
fi
rm -f "$log"
if command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ]; then
  echo "==== torch: the CUDA build (EPX_TORCH_CUDA=1) ===="
  t0=$(date +%s)
  if EPX_TORCH_CUDA=1 "$venv/bin/python" - 9>&- <<'EOF'
import epx_torch
assert epx_torch._C.with_cuda and hasattr(epx_torch._C, "_CudaLayer"), "the CUDA build has no _CudaLayer"
EOF
  then
    echo "torch[cuda] PASS the CUDA build compiles and imports ($(( $(date +%s) - t0 ))s)"
    passed=$((passed + 1))
  else
    echo "torch[cuda] FAIL the CUDA build (see the compiler's message above)"
    failed=$((failed + 1))
  fi
else
  echo "torch[cuda] SKIP the CUDA build: no nvcc on this machine"
fi
echo "$passed passed, $failed failed"
[ "$failed" -eq 0 ]
