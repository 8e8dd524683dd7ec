#!/usr/bin/env bash
# gpu_check.sh -- everything kdtr needs a GPU for, in one call per mode (a lent H200 gives 10 minutes a command
# and about 30 a session: the time limits of each mode's stages add up to less than 10 minutes).
#
#   bash tools/gpu_check.sh [MODE]...          (default: check; several modes run in the order given)
#
#   check     GPU tests (naive grid, built-ins on ci with --repeat 3, every planted bug, crash isolation;
#             not the sanitizer ones), then `kdtr verify` on ci (--repeat 3) for naive, flash, flash-sm90
#   sanitize  `kdtr verify --sanitize` memcheck and racecheck on ci for the three kernels (at once), then the
#             sanitizer tests (every kernel clean; racecheck names a planted missing hand-off)
#   long      generate the long suite (CPU reference), verify naive, flash, flash-sm90 on it
#   forced    ci verify (--repeat 3) of each forced plan branch in FORCED below (kernel-spec suffixes)
#   graph     `kdtr verify --graph` (captured at P = 0, 1, 1024, replayed at each case) of the three kernels and the
#             work-table plan on the ci and graph suites, and of each kernel's baked-lengths bug (must FAIL)
#   bench     peaks, then the compute and memory sets against torch eager: bench.json / .csv / .png under $OUT
#   serving   the compute and memory sets for flash and flash-sm90 with --graph (each launch cold and as L layers
#             replayed from one graph captured at P = 1): serving.json under $OUT
#   peer      the compute and memory sets for flash-sm90 beside FlashMLA's causal MTP decode (`flashmla-mtp`, gated
#             under a chain; SKIPPED where flash_mla does not load: carry the sgl-flash-mla wheel as the device
#             README says and put it on PYTHONPATH): peer.json under $OUT
#   compile   `kdtr compile` of the shipped builds for every arch, then of every planted-bug build (what CI compiles)
#
# Under $OUT (default out/gpu): summary.txt, logs.tgz (every log and JSON report, refreshed after each stage, so a
# command cut short still brings its logs back) and bench mode's files. The summary is printed last: one line per
# stage (exit code, seconds, the gist of its log), then tools/summary.py over the JSON reports.
set -uo pipefail

FORCED=(  # the plan branches `forced` verifies, a kernel spec each (keys: kdtr/kernels/flash/force.py)
  "flash-sm90[xr=1]"
  "flash-sm90[segments=1]"
  "flash-sm90[merge=combine]"
  "flash-sm90[merge=kernel]"
  "flash-sm90[combine=rows]"
  "flash-sm90[splits=4]"
  "flash[mt=1]"
  "flash[mt=2]"
)
KERNELS=(naive flash flash-sm90)
ARCHS=sm_80,sm_86,sm_89,sm_90,sm_90a,sm_120  # compile: portable kernels for each, flash-sm90 for sm_90a alone
MODES="check sanitize long forced graph bench serving peer compile"

for mode in "${@:-check}"; do  # every mode checked before any work
  [[ " $MODES " == *" $mode "* ]] || { echo "gpu_check.sh: unknown mode '$mode'; use one or more of: $MODES" >&2; exit 2; }
done

cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
export PYTHONUNBUFFERED=1 COLUMNS=200 KDTR_CACHE_DIR=${KDTR_CACHE_DIR:-$PWD/.kdtr-cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1 || export PYTHONPATH=$PWD
KDTR="python3 -m kdtr"
GPU=$(nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader 2>/dev/null \
      | head -n 1)

label() { echo "$1" | tr -c 'A-Za-z0-9_.\n-' '_' | sed 's/_*$//'; }  # flash-sm90[xr=1] -> flash-sm90_xr_1

stage() {  # stage NAME SECONDS CMD...: run CMD under a time limit into NAME.log; record exit code and seconds
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  timeout "$limit" "$@" >"$LOGS/$name.log" 2>&1
  rc=$?
  echo "$name $rc $((SECONDS - t0))" >>"$LOGS/stages.txt"
  [ -n "${BG:-}" ] || tar -czf "$OUT/logs.tgz" -C "$LOGS" .  # not from jobs run at once (BG=1): one writer
  return $rc
}

verify() {  # verify NAME SECONDS SPEC SUITE [OPTIONS]...: kdtr verify, its JSON report beside its log
  local name=$1 limit=$2 spec=$3 suite=$4
  shift 4
  stage "$name" "$limit" $KDTR verify -k "$spec" "$suite" "$@" --json "$LOGS/$name.json"
}

for mode in "${@:-check}"; do
  case "$mode" in
    check)
      stage pytest_gpu 400 python3 -m pytest -q -rs -p no:cacheprovider -m "gpu and not sanitizer" tests
      for k in "${KERNELS[@]}"; do verify "verify_${k}_ci" 50 "$k" ci --repeat 3; done
      ;;
    sanitize)
      for k in "${KERNELS[@]}"; do
        for tool in memcheck racecheck; do BG=1 verify "san_${k}_$tool" 240 "$k" ci --sanitize $tool & done
      done
      wait
      stage pytest_sanitizer 300 python3 -m pytest -q -rs -p no:cacheprovider -m sanitizer tests
      ;;
    long)
      OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 stage gen_long 120 $KDTR gen --suite long -j 14 \
        --out "$KDTR_CACHE_DIR/suites/long"
      verify verify_naive_long 90 naive long
      verify verify_flash_long 120 flash long --repeat 3
      verify verify_flash-sm90_long 120 flash-sm90 long --repeat 3
      ;;
    forced)
      for spec in "${FORCED[@]}"; do verify "forced_$(label "$spec")" 60 "$spec" ci --repeat 3; done
      ;;
    graph)
      for k in "${KERNELS[@]}" "flash-sm90[segments=1]"; do
        verify "graph_$(label "$k")" 120 "$k" ci graph --graph --repeat 2
      done
      for k in "${KERNELS[@]}"; do  # exit 1 expected: every one must FAIL (the summary shows it)
        verify "graph_bug_$(label "$k")" 60 "$k-bug=baked-lengths" ci --graph
      done
      ;;
    serving)
      stage serving_compute 300 $KDTR bench -k flash -k flash-sm90 --baselines none --set compute --graph --json "$LOGS/serving_compute.json"
      stage serving_memory 200 $KDTR bench -k flash -k flash-sm90 --baselines none --set memory --graph --json "$LOGS/serving_memory.json"
      stage serving_files 30 python3 tools/summary.py --merge "$OUT/serving.json" "$LOGS"/serving_*.json
      ;;
    bench)
      stage bench_peaks 45 $KDTR bench --peaks --remeasure
      stage bench_compute 270 $KDTR bench --set compute --baselines eager --json "$LOGS/bench_compute.json"
      stage bench_memory 200 $KDTR bench --set memory --baselines eager --json "$LOGS/bench_memory.json"
      stage bench_files 30 python3 tools/summary.py --merge "$OUT/bench.json" --csv "$OUT/bench.csv" \
        --plot "$OUT/bench.png" "$LOGS"/bench_compute.json "$LOGS"/bench_memory.json
      ;;
    peer)
      stage peer_compute 300 $KDTR bench -k flash-sm90 --baselines flashmla-mtp --set compute --json "$LOGS/peer_compute.json"
      stage peer_memory 200 $KDTR bench -k flash-sm90 --baselines flashmla-mtp --set memory --json "$LOGS/peer_memory.json"
      stage peer_files 30 python3 tools/summary.py --merge "$OUT/peer.json" "$LOGS"/peer_*.json
      ;;
    compile)
      stage compile_archs 200 $KDTR compile --arch "$ARCHS"
      stage compile_all_variants 300 $KDTR compile --all-variants
      ;;
  esac
done
tar -czf "$OUT/logs.tgz" -C "$LOGS" .

{
  echo "==================== gpu_check ${*:-check} on ${GPU:-no GPU that nvidia-smi sees} ===================="
  printf '%-34s %3s %5s  %s\n' stage rc s "from its log"
  while read -r name rc secs; do  # the log's last "... in N s" line (pytest's, kdtr's), else its last line of text
    text=$(LC_ALL=C grep -a '[[:alnum:]]' "$LOGS/$name.log" | LC_ALL=C grep -av '^[[:space:]]*[^[:print:]]')  # no tables
    last=$( (echo "$text" | grep -E ' in [0-9.]+ ?s([ );,]|$)' || echo "$text") | tail -n 1 | LC_ALL=C tr -cd '[:print:]' \
           | sed 's/;.*//; s/^ *//; s/ *$//' | cut -c1-110)
    printf '%-34s %3s %5s  %s\n' "$name" "$rc" "$secs" "$last"
  done <"$LOGS/stages.txt"
  reports=$(ls "$LOGS"/*.json 2>/dev/null)
  [ -n "$reports" ] && echo && python3 tools/summary.py $reports 2>&1
} >"$OUT/summary.txt"
cat "$OUT/summary.txt"
! awk '$2 != 0 {bad = 1} END {exit !bad}' "$LOGS/stages.txt"
