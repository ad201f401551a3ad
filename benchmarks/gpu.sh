#!/usr/bin/env bash
# The kernel papers' GPU check, under 8 minutes on one GPU (issue 27):
#   1. the kernel tests compiled (bf16 included; the `gpu`-marked ones run too), one autotune config per kernel;
#   2. benchmarks/kernels.py at the papers' sizes, autotuned -> benchmarks/results/kernels-<gpu>.json;
#   3. the smoke profiles of tbik, token_sparse_attention and t3_video, on the GPU.
# The step times and outcomes are added to the same JSON under "gpu_sh".
#
#   benchmarks/gpu.sh               # on a machine with a CUDA GPU (falls back to --cpu-check without one)
#   benchmarks/gpu.sh --cpu-check   # the CPU-safe parts: kernel tests interpreted, kernels.py --quick, the kernels
#                                   # compiled for sm_90 without a GPU (kernels.py --aot), the smoke command
#                                   # printed, not run; writes nothing under benchmarks/results/
#
# Time limits (seconds): TOTAL_S (default 470) for the three steps together, TESTS_S (150) and BENCH_S (210) for the
# first two; the smoke profiles get what is left. PY picks the Python.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
KERNEL_TESTS=(tests/test_tbik.py tests/test_window_attention.py tests/test_token_sparse_attention.py)
SMOKE=(tbik token_sparse_attention t3_video)

mode=gpu
[[ "${1:-}" == "--cpu-check" ]] && mode=cpu
if [[ $mode == gpu ]] && ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu.sh: no CUDA GPU here; running the CPU-safe parts (--cpu-check)"
    mode=cpu
fi

if [[ $mode == cpu ]]; then
    set -e
    echo "== 1/4 kernel tests, interpreted (TRITON_INTERPRET=1); the gpu-marked ones are skipped without CUDA"
    "$PY" -m pytest -q -p no:cacheprovider -rs "${KERNEL_TESTS[@]}"
    echo "== 2/4 benchmarks/kernels.py --quick (PyTorch paths, tiny sizes)"
    out=$(mktemp -d)/kernels-cpu-check.json
    "$PY" benchmarks/kernels.py --quick --out "$out" > /dev/null
    "$PY" -c "import json, sys; d = json.load(open(sys.argv[1])); print({k: len(v) for k, v in d.items() if isinstance(v, list)})" "$out"
    echo "== 3/4 kernels compiled ahead of time for sm_90 (Triton + ptxas, no GPU): registers and spills"
    "$PY" benchmarks/kernels.py --aot 2>&1 | grep -v -i warn | "$PY" -c "
import ast, sys
for line in sys.stdin:
    r = ast.literal_eval(line) if line.startswith('{') else None
    if r: print(r['kernel'], {k: v for k, v in r['config'].items() if k in ('BM', 'BN', 'num_warps')},
                'ok' if r['ok'] else r['error'], r.get('registers'), 'regs', r.get('spill_bytes'), 'B spilled')"
    echo "== 4/4 smoke profiles (GPU only; would run): $PY -m flows.cli run ${SMOKE[*]} --profile smoke --force --parallel 3"
    echo "gpu.sh --cpu-check: ok"
    exit 0
fi

slug=$("$PY" -c "import re, torch; print(re.sub(r'[^a-z0-9]+', '-', torch.cuda.get_device_name().lower()).strip('-'))")
result=benchmarks/results/kernels-$slug.json
log=benchmarks/results/gpu-$slug.log
: > "$log"
SECONDS=0
steps=()
step() {  # step NAME LIMIT CMD...: run with a time limit, log its output, remember rc and seconds
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*" | tee -a "$log"
    local t0=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee -a "$log"
    local rc=${PIPESTATUS[0]}
    steps+=("$name $rc $((SECONDS - t0))")
    echo "== $name: rc $rc in $((SECONDS - t0)) s" | tee -a "$log"
}

step tests "${TESTS_S:-150}" env PAPERLINE_AUTOTUNE=0 "$PY" -m pytest -q -p no:cacheprovider -rs "${KERNEL_TESTS[@]}"
step benchmarks "${BENCH_S:-210}" "$PY" benchmarks/kernels.py --out "$result"
left=$(( ${TOTAL_S:-470} - SECONDS ))
(( left < 60 )) && left=60
step smoke "$left" "$PY" -m flows.cli run "${SMOKE[@]}" --profile smoke --force --parallel 3

"$PY" - "$result" "$log" "${steps[@]}" <<'EOF'
import json, re, sys
from pathlib import Path

path, log, steps = Path(sys.argv[1]), Path(sys.argv[2]).read_text(), sys.argv[3:]
data = json.loads(path.read_text()) if path.exists() else {}
summary = re.findall(r"^=* ?(\d+ passed.*|.*failed.*) in [\d.]+s", log, re.M)
claims = [line for line in log.splitlines() if "holds" in line]
data["gpu_sh"] = {"steps": {s.split()[0]: {"rc": int(s.split()[1]), "seconds": int(s.split()[2])} for s in steps},
                  "tests": summary[-1] if summary else None, "smoke_claims": claims[-3:]}
path.write_text(json.dumps(data, indent=1))
print(json.dumps(data["gpu_sh"], indent=1))
EOF
echo "gpu.sh: results in $result, log in $log"
for s in "${steps[@]}"; do [[ $(echo "$s" | cut -d' ' -f2) == 0 ]] || exit 1; done
