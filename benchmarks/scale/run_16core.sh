#!/usr/bin/env bash
# The cluster-scale benchmark on a machine with at least 16 free cores, where a 16-rank build's wall
# time is real (on the 2-core benchmark box the ranks are oversubscribed and only their CPU seconds
# say how the work divides). Writes scale.log and scale.json under OUT.
#
#   bash benchmarks/scale/run_16core.sh OUT [RANKS...]
#
# With no RANKS given it takes 1 2 4 8 16 where a 1e7-step Python loop runs in under 0.55 s (0.86 s
# on the 2-core box), else 1 4 16, so that the run fits BUDGET_S seconds (default 570; bench_scale
# is stopped there, and its log so far is kept).
# Needs tokenloom importable (PYTHONPATH=src is set here), numba, torch and megatron-core 0.19.2.
# Steps: the 1e11-token corpus (sparse .bin); numba's cache filled by a small one- and two-rank build in
# each mode, so that no try of the real run compiles; then bench_scale.py, best of REPEATS (default 2)
# tries of each build, megatron-core's cold build before and after the ranks. CORPUS_ARGS overrides
# the corpus (a smaller one for a rehearsal of this script).
set -uo pipefail
out=${1:?usage: run_16core.sh OUT [RANKS...]}
shift
ranks=${*:-}
here=$(cd "$(dirname "$0")/../.." && pwd)
cd "$here" || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH="$here/src${PYTHONPATH:+:$PYTHONPATH}"
py=${PYTHON:-python3}
work=${WORK:-/tmp/tl_16core}
mkdir -p "$out" "$work"
started=$(date +%s)
stamp() { echo "[$(( $(date +%s) - started )) s] $*"; }
stamp "cores: $(nproc); $($py -c 'import sys, numpy, numba, torch; print("python", sys.version.split()[0], "numpy", numpy.__version__, "numba", numba.__version__, "torch", torch.__version__)')"
$py -c "import megatron.core.datasets.helpers_cpp, tokenloom; from tokenloom.index.kernels import numba_available; assert numba_available(), 'numba is not usable'" || exit 1
# shellcheck disable=SC2086
$py benchmarks/make_corpus.py --out "$work/corpus" ${CORPUS_ARGS:---stores 1000 --tokens 1e11 --documents 1e8} >/dev/null || exit 1
stamp "corpus written"
$py benchmarks/make_corpus.py --out "$work/small" --stores 8 --tokens 1e8 --documents 1e5 >/dev/null || exit 1
$py benchmarks/scale/ranks.py --corpus "$work/small" --work "$work/small-build" --ranks 1 2 --repeats 1 >"$out/warmup.log" 2>&1 || exit 1
stamp "numba cache filled"
# the box's speed as bench_scale reads it: seconds of a 1e7-step Python loop
loop=$($py -c 'import sys; sys.path.insert(0, "benchmarks"); from bench_scale import box_speed
print(round(box_speed()["python_loop_s"], 2))') || exit 1
if [ -z "$ranks" ]; then
  if $py -c "import sys; sys.exit(0 if $loop < 0.55 else 1)"; then ranks="1 2 4 8 16"; else ranks="1 4 16"; fi
fi
left=$(( ${BUDGET_S:-570} - ($(date +%s) - started) ))
stamp "a 1e7-step loop: $loop s; ranks: $ranks; $left s left for bench_scale"
# shellcheck disable=SC2086
timeout "$left" $py benchmarks/bench_scale.py --corpus "$work/corpus" --work "$work/scale" --ranks $ranks --repeats "${REPEATS:-2}" \
    --skip warm first_use --json "$out/scale.json" 2>&1 | tee "$out/scale.log"
status=${PIPESTATUS[0]}
stamp "bench_scale finished with status $status"
exit "$status"
