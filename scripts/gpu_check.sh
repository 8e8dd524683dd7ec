#!/usr/bin/env bash
# gpu_check.sh -- everything kdtr needs a GPU for, in one call (the lent H200 has ~30 min a session).
#
#   bash scripts/gpu_check.sh [check|long|bench|all]...   (default: check)
#
#   check : GPU pytest (naive kernel grid, built-ins on ci with --repeat 3, every planted bug)
#           + `kdtr verify` tables for naive, flash and flash-sm90 on ci
#   long  : generate the long suite (CPU reference, -j 8) and verify naive + flash + flash-sm90 on it
#   bench : peaks + the compute and memory shape sets with torch baselines (JSON, CSV, plot)
#   quick : flash + naive timings on a few shapes, no baselines
#   sm90  : flash-sm90 block errors (stops there on failure), ci verify, bugs, timing against flash
#   final : flash-sm90 and flash on the long suite, then flash-sm90 on the compute and memory sets against torch eager
#   sets  : only final's timings
#   longflash: only final's long-suite verification
#   flashci: both flash kernels on ci and every flash GPU test
#   pdl   : dependent combine launches: ci, flash tests, sanitizers, timings with KDTR_PDL=0/1 and KDTR_FLASH_MERGE=0
#   combine: both flash kernels on ci (--repeat 3) and their planted bugs, then scripts/time_steps.py
#   verify: every built-in kernel on ci, every planted bug, flash-sm90 under memcheck/racecheck
#   merge : flash-sm90's in-kernel merge: ci, bugs, timings with KDTR_FLASH_MERGE=0/1
#   sol   : both flash kernels on ci and their bugs, then scripts/sol_probe.py (bare-read speed of light, flush A/B)
#   ceiling: scripts/sol_probe.py alone: the best of three bare reads of the decode bytes as a share of the copy peak
#   ablate: flash-sm90 experiment knobs (KDTR_F90_STAGES=3/4): block errors, then timings
#   ncu   : stall reasons and pipe use of one flash-sm90 launch (compute and memory shape)
#   abtree: flash-sm90 of an exported older tree (ab_old/, e.g. `git archive HEAD~1 kdtr cuda | tar -x -C ab_old`)
#           and of this tree, timed one after the other on the same machine (scripts/sm90_ablate.py $AB_SHAPES)
#   knobs : flash-sm90 -D experiment builds ($KNOBS: LABEL=OPTS;...) verified on ci, profiled per loop section
#           (scripts/f90_profile.py), then timed
#   prologue: the consumers' tail-tile scan under the producer's Q loads: ci (forced paths too), A/B against ab_old/, profiles
#   prologue2: prologue's checks: ci (forced paths too), every flash test, sanitizers, A/B against ab_old/
#   xr    : flash-sm90's transposed rows: ci (planned, then forced) + sanitizers, flash tests, timings of ab_old/ (if any),
#           KDTR_FLASH_XR=0 and =1
#   tailprof: Kimi T9 B1 profiled as planned and with KDTR_FLASH_TAIL=1 (the tail launch's grid beside the first),
#           then Kimi T1 P32k / P64k and T9 P32k B1 (a CTA's tile rate from DRAM against from L2)
#   xonlyprof: Kimi T1 B1 profiled and timed as planned, XR_ONLY forced, XR_ONLY forced on 132 splits
#   narrow: the narrow combine: ci, flash tests, flash sanitizer tests, Kimi T1 timings, the sweep
#   flashnarrow: flash (mma.sync) under the narrow combine: sanitizers (forced), timings; flash-sm90's T5 B1 merges
#   narrow64: the narrow combine's 64-column chunks: ci, flash tests, sanitizers (forced too), timings of both kernels
#   abtree2: ab_old/ against this tree twice, interleaved, both flash kernels (scripts/ab_table.py)
#   narrowwarps: the narrow merge's 4- or 8-warp builds: ci, flash tests, sanitizer tests, interleaved A/B
#   rowsparts: the warp-per-row merge by half rows: ci, merge tests, sanitizer tests, interleaved A/B
#   sfirst: S(i+1) before P V(i) (-DKDTR_F90_S_FIRST=1) at 2, 3 and 4 stages: ci, interleaved timings, profile
#   capsweep: the whole sweep, shipped build against S first at 3 and 4 stages (above 99 KB: what the cap costs)
#   qskip : does Q's two-round load gate the first S? (-DKDTR_F90_Q_SKIP builds, timing only) timings and profiles
#   noop  : builds of the same code with an unused -D, timed against the shipped build (how far apart builds time)
#   loadorder: the same builds as noop in another load order, with the register stores between them
#   rowstores: the row stores (the default) against the register stores, each build its own process; ci, tests, sanitizers
#   placement: cubin md5s of fresh compiles (scripts/build_hashes.py), the shipped build's speed over reloads (reload_spread.py)
#   tau   : the running maximum kept within TAU (-DKDTR_F90_RESCALE_TAU=8): ci with margins, timings each build apart
#   earlyxr: the XR build's early alpha hand-off against -DKDTR_F90_EARLY_ALPHA=0: ci, bits, timings, racecheck (XR forced)
#   partials: split partials in the output's type (-DKDTR_PARTIAL_AS_OUT): ci with margins, timings each build apart
#   halfrescale: O's rescale voted per half warp (-DKDTR_F90_HALF_RESCALE=1): ci, bits against the plain build, timings, profile
#   reload: the shipped build's modules loaded afresh $RELOADS times (default 12) in one process, each load timed
#   reloaddata: the same, one load of the modules and the inputs placed anew each round (reload_spread.py --data)
#   clusters: thread-block clusters of flash-sm90's main build that fit at once, by cluster size
#   speed : is an SM's streaming rate its own, and when do XR_ONLY's first tiles land (scripts/sm_speed.py)
#   promotion: the cache map's L2 promotion: ci, flash-sm90's GPU tests, the compute and memory sets
#   ncuxonly: per-instruction stall samples of XR_ONLY (Kimi T1 P128k B32 planned, B1 forced) and the 64-row B1
#   xonly : flash-sm90's XR_ONLY decode: ci, its GPU tests, timings as planned, KDTR_FLASH_XR=0 and =1
#   seg   : flash-sm90's segments: ci (planned, then forced) + every flash test + forced-path sanitizer tests, then
#           timings of ab_old/ (if any), KDTR_FLASH_SEGMENTS=0 and as planned
#   wgmma : tensor-pipe rate of flash-sm90's wgmma chains (scripts/wgmma_probe.py)
#   sm90tests: every flash GPU test, then flash-sm90's sanitizer tests (tests/test_gpu_isolation.py)
#   sanitize, robust, devices, mtcmp, mtmem: see each case below
#
# Results go to $OUT (default ./out/gpu): summary.txt, logs.tgz (every log and verify JSON) and the
# bench JSON/CSV/PNG (the device tool brings back at most 8 files). A short summary is printed last.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-out/gpu}
mkdir -p "$OUT"
LOGS=$(mktemp -d)
export PYTHONUNBUFFERED=1 KDTR_CACHE_DIR=${KDTR_CACHE_DIR:-$PWD/.kdtr-cache}
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$LOGS/install.log" 2>&1 || export PYTHONPATH=$PWD
KDTR="python3 -m kdtr.cli"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"
note() { echo "$*" | tee -a "$SUMMARY"; }

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader >>"$SUMMARY" 2>&1

stage() {  # stage NAME CMD...: run, log, record rc and seconds
  local name=$1; shift
  local t0=$SECONDS
  "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  note "$(printf '%-28s rc=%-3s %5ss' "$name" "$rc" "$((SECONDS - t0))")"
  tar -czf "$OUT/logs.tgz" -C "$LOGS" .  # after every stage: a run cut short still brings its logs back
  return $rc
}

ci_verify() {  # ci_verify KERNEL...: each on the ci suite, --repeat 3
  for k in "$@"; do
    stage verify_${k}_ci timeout 90 $KDTR verify -k $k ci --repeat 3 --json "$LOGS/verify_${k}_ci.json"
    tail -n 1 "$LOGS/verify_${k}_ci.log" >>"$SUMMARY"
  done
}

flash_tests() {  # every flash GPU test but the long suite: planted bugs of both kernels, both merge paths
  stage pytest_flash timeout 360 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_verify.py -k "flash and not long"
  tail -n 2 "$LOGS/pytest_flash.log" >>"$SUMMARY"
}

flash_san_tests() {  # the flash and flash-sm90 sanitizer tests of tests/test_gpu_isolation.py (memcheck, racecheck)
  stage pytest_san timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_isolation.py -k "flash and sanitizer"
  tail -n 3 "$LOGS/pytest_san.log" >>"$SUMMARY"
}

flash_combine_timings() {  # flash_combine_timings BUDGETS LABEL...: `flash` on Kimi decode B1-B2, per label as planned
  local budgets=$1 c; shift   # or, for label "split", with the 128-column combine (KDTR_FLASH_COMBINE="" is the plan's)
  for c in "$@"; do
    KDTR_FLASH_COMBINE=$([ "$c" = split ] && echo split) stage bench_flash_$c timeout 150 $KDTR bench -k flash \
      --baselines none --model kimi-k2 --tp 8 --budget "$budgets" --prefix 32k,128k --batch 1,2 --no-check \
      --json "$LOGS/bench_flash_$c.json"
    note "flash, combine $c:"
    python3 scripts/bench_summary.py "$LOGS/bench_flash_$c.json" >>"$SUMMARY"
  done
}

sanitize_ci() {  # sanitize_ci KERNEL...: memcheck and racecheck on the ci suite, all at once; JSON to $OUT
  for k in "$@"; do
    for tool in memcheck racecheck; do
      (timeout 200 $KDTR verify -k $k ci --sanitize $tool --json "$LOGS/san_${k}_$tool.json" \
         >"$LOGS/san_${k}_$tool.log" 2>&1; echo "$k $tool rc=$?" >>"$LOGS/san_rc.txt") &
    done
  done
  wait
  cat "$LOGS/san_rc.txt" >>"$SUMMARY"
  for f in "$LOGS"/san_*.log; do tail -n 1 "$f" | sed "s|^ *|$(basename "$f" .log): |" >>"$SUMMARY"; done
  cp "$LOGS"/san_*.json "$OUT/" 2>/dev/null
  tar -czf "$OUT/logs.tgz" -C "$LOGS" .
}

reload_spread() {  # reload_spread K [--data]: the shipped build's modules (or inputs) placed anew K times in one process
  stage reload_spread timeout 400 python3 scripts/reload_spread.py "$@"
  grep -v Warn "$LOGS/reload_spread.log" | tail -n $(($1 + 3)) >>"$SUMMARY"
}

long_flash() {  # generate the long suite (CPU reference), verify flash-sm90 and flash on it
  OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 stage gen_long timeout 100 $KDTR gen --suite long -j 14 --out "$KDTR_CACHE_DIR/suites/long"
  stage verify_sm90_long timeout 120 $KDTR verify -k flash-sm90 long --repeat 3 --json "$LOGS/verify_sm90_long.json"
  tail -n 2 "$LOGS/verify_sm90_long.log" >>"$SUMMARY"
  stage verify_flash_long timeout 150 $KDTR verify -k flash long --repeat 3 --json "$LOGS/verify_flash_long.json"
  tail -n 2 "$LOGS/verify_flash_long.log" >>"$SUMMARY"
}

old_tree_timings() {  # old_tree_timings SET: flash-sm90 of ab_old/ (an exported older tree) on sm90_ablate.py's SET
  [ -d ab_old/kdtr ] || return 1
  KDTR_CACHE_DIR=$PWD/.kdtr-cache-old PYTHONPATH=$PWD/ab_old stage ab_old timeout 200 python3 scripts/sm90_ablate.py "$1" old=
  grep -v Warn "$LOGS/ab_old.log" | tail -n 48 >>"$SUMMARY"
}

ab_timings() {  # ab_timings SET [LINES]: ab_old/ (if any) and this tree's flash-sm90 on sm90_ablate.py's SET, one machine
  old_tree_timings "$1" || note "no ab_old/ tree: this tree alone"
  stage ab_new timeout 200 python3 scripts/sm90_ablate.py "$1" new=
  grep -v Warn "$LOGS/ab_new.log" | tail -n "${2:-48}" >>"$SUMMARY"
}

ab_interleaved() {  # ab_interleaved SET: ab_old/ (if any) and this tree twice, old / new / old / new, one machine:
  local i tree envs  # flash-sm90 on sm90_ablate.py's SET, flash on Kimi decode B1; one table per kernel
  for i in 1 2; do
    for tree in old new; do
      [ $tree = old ] && [ ! -d ab_old/kdtr ] && continue
      envs=$([ $tree = old ] && echo "KDTR_CACHE_DIR=$PWD/.kdtr-cache-old PYTHONPATH=$PWD/ab_old")
      stage ab_$tree$i env $envs timeout 200 python3 scripts/sm90_ablate.py "$1" $tree$i=
      stage flash_$tree$i env $envs timeout 100 python3 -m kdtr.cli bench -k flash --baselines none --model kimi-k2 \
        --tp 8 --budget 0,8 --prefix 32k,128k --batch 1 --no-check --json "$LOGS/flash_$tree$i.json"
    done
  done
  python3 scripts/ab_table.py "$LOGS"/ab_*.log >>"$SUMMARY"
  for f in "$LOGS"/flash_*.json; do note "$(basename "$f" .json):"; python3 scripts/bench_summary.py "$f" >>"$SUMMARY"; done
}

forced_ci() {  # forced_ci: flash-sm90 on ci (--repeat 3) with transposed rows, segments and the combine launch forced
  for envs in KDTR_FLASH_XR=1 KDTR_FLASH_SEGMENTS=1 KDTR_FLASH_MERGE=0; do
    label=$(echo "$envs" | sed 's/KDTR_FLASH_//; s/=/-/')
    stage verify_${label}_ci env $envs timeout 90 $KDTR verify -k flash-sm90 ci --repeat 3 --json "$LOGS/verify_${label}_ci.json"
    tail -n 1 "$LOGS/verify_${label}_ci.log" | sed "s|^|$label: |" >>"$SUMMARY"
  done
}

bench_sets() {  # flash-sm90 on the compute and memory shape sets against torch eager; JSON to $OUT
  for set in compute memory; do
    remeasure=$([ $set = compute ] && echo --remeasure)  # peaks measured in this call, then reused by the memory set
    stage bench_f_$set timeout 150 $KDTR bench -k flash-sm90 --baselines eager --set $set --no-check $remeasure --json "$LOGS/bench_f_$set.json"
    cp "$LOGS/bench_f_$set.json" "$OUT/" 2>/dev/null
  done
  python3 scripts/bench_summary.py "$LOGS"/bench_f_*.json >>"$SUMMARY"
}

for mode in "${@:-check}"; do
  case "$mode" in
    check)
      stage pytest_gpu timeout 420 python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_gpu_naive.py tests/test_gpu_verify.py
      tail -n 4 "$LOGS/pytest_gpu.log" >>"$SUMMARY"
      stage verify_naive_ci $KDTR verify -k naive ci --repeat 3 --json "$LOGS/verify_naive_ci.json"
      stage verify_flash_ci $KDTR verify -k flash ci --repeat 3 --json "$LOGS/verify_flash_ci.json"
      stage verify_sm90_ci $KDTR verify -k flash-sm90 ci --repeat 3 --json "$LOGS/verify_sm90_ci.json"
      tail -n 1 "$LOGS/verify_naive_ci.log" "$LOGS/verify_flash_ci.log" "$LOGS/verify_sm90_ci.log" >>"$SUMMARY"
      ;;
    long)
      OMP_NUM_THREADS=2 OPENBLAS_NUM_THREADS=2 stage gen_long $KDTR gen --suite long -j 8 --out "$KDTR_CACHE_DIR/suites/long"
      stage verify_naive_long $KDTR verify -k naive long --json "$LOGS/verify_naive_long.json"
      stage verify_flash_long $KDTR verify -k flash long --repeat 3 --json "$LOGS/verify_flash_long.json"
      stage verify_sm90_long $KDTR verify -k flash-sm90 long --repeat 3 --json "$LOGS/verify_sm90_long.json"
      python3 scripts/verify_summary.py "$LOGS"/verify_*_long.json >>"$SUMMARY"
      ;;
    quick)
      stage bench_quick $KDTR bench -k flash --baselines eager,sdpa,flex --model deepseek-v3 --tp 8 --budget 64,256 \
        --prefix 8k,32k --batch 1 --json "$LOGS/bench_quick.json"
      stage bench_quick_mem $KDTR bench -k flash --baselines none --model kimi-k2 --tp 8 --budget 0,4,8 \
        --prefix 32k --batch 1,32 --json "$LOGS/bench_quick_mem.json"
      python3 scripts/bench_summary.py "$LOGS"/bench_quick*.json >>"$SUMMARY"
      ;;
    sm90)  # the wgmma kernel: block errors, ci verify, bugs, a quick timing against flash
      if ! stage sm90_debug timeout 60 python3 scripts/sm90_debug.py flash-sm90; then
        grep -v Warn "$LOGS/sm90_debug.log" | tail -n 30 >>"$SUMMARY"; note "sm90_debug failed: stopping"; break
      fi
      cat "$LOGS/sm90_debug.log" | grep -v Warn | tail -n 40 >>"$SUMMARY"
      stage verify_sm90_ci timeout 90 $KDTR verify -k flash-sm90 ci --repeat 3 --json "$LOGS/verify_sm90_ci.json"
      tail -n 22 "$LOGS/verify_sm90_ci.log" >>"$SUMMARY"
      stage bench_sm90 timeout 90 $KDTR bench -k flash -k flash-sm90 --baselines none --model deepseek-v3 --tp 8 \
        --budget 64,256 --prefix 8k,32k --batch 1 --no-check --json "$LOGS/bench_sm90.json"
      stage bench_sm90_mem timeout 90 $KDTR bench -k flash -k flash-sm90 --baselines none --model kimi-k2 --tp 8 \
        --budget 0,4,8 --prefix 32k --batch 1,32 --no-check --json "$LOGS/bench_sm90_mem.json"
      python3 scripts/bench_summary.py "$LOGS"/bench_sm90*.json >>"$SUMMARY"
      for f in "$KDTR_CACHE_DIR"/cubin/*.cubin; do
        n=$(cuobjdump -sass "$f" 2>/dev/null | grep -c HGMMA); [ "$n" -gt 0 ] && echo "$(basename "$f"): $n HGMMA" >>"$SUMMARY"
      done
      stage pytest_sm90 timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_verify.py -k sm90
      tail -n 4 "$LOGS/pytest_sm90.log" >>"$SUMMARY"
      ;;
    final)  # flash-sm90 and flash on the long suite, then the compute and memory sets against torch eager
      long_flash
      bench_sets
      ;;
    longflash)  # flash-sm90 and flash on the long suite (final's first half)
      long_flash
      ;;
    sets)  # flash-sm90 on the compute and memory sets against torch eager (final's timings alone)
      bench_sets
      ;;
    sm90tests)  # every flash test and flash-sm90's sanitizer tests (the isolation module's, transposed rows included)
      flash_tests
      stage pytest_san timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_isolation.py -k "sm90 or sanitizer"
      tail -n 3 "$LOGS/pytest_san.log" >>"$SUMMARY"
      ;;
    flashci)  # both flash kernels on ci (--repeat 3) and every flash GPU test (planted bugs, both merges)
      ci_verify flash flash-sm90
      flash_tests
      ;;
    pdl)  # dependent combine launches (kdtr/kernels/pdl.py): ci for both kernels (flash-sm90 also with KDTR_PDL=0), every flash
          # test (the dependent-launch probe included), both under the sanitizers, then this tree timed with KDTR_PDL=0
          # and 1 alternately (separate processes) and, dependent, with the combine launch instead of the in-kernel merge
      ci_verify flash flash-sm90
      KDTR_PDL=0 stage verify_pdl0_ci timeout 90 $KDTR verify -k flash-sm90 ci --repeat 3 --json "$LOGS/verify_pdl0_ci.json"
      tail -n 1 "$LOGS/verify_pdl0_ci.log" >>"$SUMMARY"
      flash_tests
      sanitize_ci flash flash-sm90
      for x in 0 1 0 1; do
        KDTR_PDL=$x stage ab_pdl$x timeout 200 python3 scripts/sm90_ablate.py "${AB_SHAPES:-balance}" pdl$x=
        grep -v Warn "$LOGS/ab_pdl$x.log" | tail -n 40 >>"$SUMMARY"
      done
      KDTR_FLASH_MERGE=0 stage ab_merge0 timeout 200 python3 scripts/sm90_ablate.py decode pdl1merge0=
      grep -v Warn "$LOGS/ab_merge0.log" | tail -n 40 >>"$SUMMARY"
      ;;
    combine)  # both flash kernels after a change to their shared split plan / combine: ci, bugs, step timings
      ci_verify flash flash-sm90
      flash_tests
      stage time_steps timeout 120 python3 scripts/time_steps.py flash-sm90
      grep -v Warn "$LOGS/time_steps.log" >>"$SUMMARY"
      ;;
    verify)  # every built-in kernel on ci (--repeat 3), every planted bug, flash-sm90 under memcheck and racecheck
      ci_verify naive flash flash-sm90
      stage pytest_verify timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_verify.py
      tail -n 2 "$LOGS/pytest_verify.log" >>"$SUMMARY"
      sanitize_ci flash-sm90
      ;;
    merge)  # flash-sm90's in-kernel split merge: ci and bugs of both flash kernels, then timings with and without it
      ci_verify flash flash-sm90
      flash_tests
      for m in 0 1; do
        KDTR_FLASH_MERGE=$m stage ablate_merge$m timeout 150 python3 scripts/sm90_ablate.py merge$m=""
        grep -v Warn "$LOGS/ablate_merge$m.log" | tail -n 24 >>"$SUMMARY"
      done
      ;;
    sol)  # both flash kernels on ci and their bugs, then the decode speed-of-light probe (flush A/B)
      ci_verify flash flash-sm90
      flash_tests
      stage sol_probe timeout 300 python3 scripts/sol_probe.py --flush flash-sm90
      grep -v Warn "$LOGS/sol_probe.log" >>"$SUMMARY"
      ;;
    ceiling)  # session 23: the best bare read of the decode bytes (three read strategies) against the memory target
      stage sol_probe timeout 300 python3 scripts/sol_probe.py flash-sm90
      grep -v Warn "$LOGS/sol_probe.log" >>"$SUMMARY"
      ;;
    ablate)  # flash-sm90 built with its -D knobs (scripts/sm90_ablate.py), after a correctness check of each
      if ! stage sm90_debug_knobs timeout 90 python3 scripts/sm90_debug.py flash-sm90 \
          stages3="-DKDTR_F90_STAGES=3 -DKDTR_F90_EXPERIMENT" stages4="-DKDTR_F90_STAGES=4 -DKDTR_F90_EXPERIMENT"; then
        grep -v Warn "$LOGS/sm90_debug_knobs.log" | tail -n 30 >>"$SUMMARY"; note "sm90_debug failed: stopping"; break
      fi
      grep "out rel" "$LOGS/sm90_debug_knobs.log" | sed -E 's/^([^ =]+)[^:]*: out rel ([0-9.e+-]+).*/\1 \2/' | tr '\n' ' ' >>"$SUMMARY"
      stage verify_sm90_ci timeout 90 $KDTR verify -k flash-sm90 ci --repeat 3 --json "$LOGS/verify_sm90_ci.json"
      tail -n 1 "$LOGS/verify_sm90_ci.log" >>"$SUMMARY"
      stage pytest_sm90 timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_verify.py -k flash-sm90
      tail -n 1 "$LOGS/pytest_sm90.log" >>"$SUMMARY"
      stage sm90_ablate timeout 300 python3 scripts/sm90_ablate.py
      grep -v Warn "$LOGS/sm90_ablate.log" | tail -n 60 >>"$SUMMARY"
      ;;
    abtree)  # an older tree's flash-sm90 against this one, same machine, same shapes
      ab_timings "${AB_SHAPES:-balance}" 40
      ;;
    prologue)  # session 11: the consumers' tail-tile scan while the producer loads Q at entry: ci (planned, then with
               # transposed rows, segments and the combine launch forced), this tree against ab_old/ on $AB_SHAPES
               # (default balance), then both trees' prologue steps (scripts/f90_profile.py decode and small)
      ci_verify flash-sm90
      forced_ci
      ab_timings "${AB_SHAPES:-balance}"
      for set in decode small; do
        [ -d ab_old/kdtr ] && KDTR_CACHE_DIR=$PWD/.kdtr-cache-old PYTHONPATH=$PWD/ab_old stage prof_old_$set timeout 120 \
          python3 scripts/f90_profile.py $set
        stage prof_new_$set timeout 120 python3 scripts/f90_profile.py $set
      done
      grep -h -i "prologue\|first tile\|loop\|launch" "$LOGS"/prof_*.log | head -n 60 >>"$SUMMARY"
      ;;
    prologue2)  # session 11, the checks after the prologue change: ci (planned and forced paths), every flash GPU test,
                # memcheck / racecheck on ci, then this tree against ab_old/ on $AB_SHAPES (default balance)
      ci_verify flash flash-sm90
      forced_ci
      flash_tests
      sanitize_ci flash-sm90
      ab_timings "${AB_SHAPES:-balance}"
      ;;
    xr)  # flash-sm90's transposed rows: ci (the plan's choice, then forced wherever they apply) with the sanitizers,
         # every flash test, then timings of ab_old/ (if any), transposed rows off and forced, on one machine
      ci_verify flash-sm90
      KDTR_FLASH_XR=1 stage verify_xr1_ci timeout 90 $KDTR verify -k flash-sm90 ci --repeat 3 --json "$LOGS/verify_xr1_ci.json"
      tail -n 1 "$LOGS/verify_xr1_ci.log" >>"$SUMMARY"
      flash_tests
      KDTR_FLASH_XR=1 sanitize_ci flash-sm90
      old_tree_timings xr
      for x in 0 1; do
        KDTR_FLASH_XR=$x stage ab_xr$x timeout 150 python3 scripts/sm90_ablate.py xr xr$x=
        grep -v Warn "$LOGS/ab_xr$x.log" | tail -n 48 >>"$SUMMARY"
      done
      ;;
    xonly)  # flash-sm90's XR_ONLY decode (8 rows, all transposed, two CTAs per SM): ci and its GPU tests, then
            # timings as planned, with transposed rows off (the 64-row build) and forced (XR_ONLY), one machine
      ci_verify flash-sm90
      stage pytest_xonly timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_verify.py \
        -k "all_rows_transposed or merges_are_exact or (planted_bug_fails_ci and sm90)"
      tail -n 3 "$LOGS/pytest_xonly.log" >>"$SUMMARY"
      stage ab_xonly timeout 300 python3 scripts/sm90_ablate.py xonly planned= xr0=KDTR_FLASH_XR=0 xr1=KDTR_FLASH_XR=1
      grep -v Warn "$LOGS/ab_xonly.log" | tail -n 30 >>"$SUMMARY"
      ;;
    seg)  # flash-sm90's segments (work table, kdtr/kernels/flash/schedule.py): ci planned and forced, every flash test, ci and the
          # forced paths under the sanitizers, then timings with segments off and as planned, on one machine
      ci_verify flash-sm90
      KDTR_FLASH_SEGMENTS=1 stage verify_seg1_ci timeout 90 $KDTR verify -k flash-sm90 ci --repeat 3 --json "$LOGS/verify_seg1_ci.json"
      tail -n 1 "$LOGS/verify_seg1_ci.log" >>"$SUMMARY"
      flash_tests
      sanitize_ci flash-sm90
      stage pytest_san_forced timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_isolation.py -k forced_paths
      tail -n 3 "$LOGS/pytest_san_forced.log" >>"$SUMMARY"
      old_tree_timings segments
      for envs in "KDTR_FLASH_SEGMENTS=0" ""; do
        label=$(echo "${envs:-planned}" | sed 's/KDTR_FLASH_//g; s/ /,/g; s/=/-/g')
        stage ab_$label env $envs timeout 150 python3 scripts/sm90_ablate.py segments $label=
        grep -v Warn "$LOGS/ab_$label.log" | tail -n 48 >>"$SUMMARY"
      done
      ;;
    xonlyprof)  # Kimi T1 B1 profiled and timed: the 64-row plan, XR_ONLY (two CTAs an SM) and XR_ONLY on 132 splits
      stage prof_t1 timeout 200 python3 scripts/f90_profile.py t1
      grep -v Warn "$LOGS/prof_t1.log" | tail -n 16 >>"$SUMMARY"
      KDTR_FLASH_XR=1 stage prof_t1_x timeout 200 python3 scripts/f90_profile.py t1
      grep -v Warn "$LOGS/prof_t1_x.log" | tail -n 16 >>"$SUMMARY"
      KDTR_FLASH_XR=1 KDTR_FLASH_SPLITS=132 stage prof_t1_x132 timeout 200 python3 scripts/f90_profile.py t1
      grep -v Warn "$LOGS/prof_t1_x132.log" | tail -n 16 >>"$SUMMARY"
      stage ab_t1 timeout 200 python3 scripts/sm90_ablate.py t15 base= x="KDTR_FLASH_XR=1" x132="KDTR_FLASH_XR=1 KDTR_FLASH_SPLITS=132"
      grep -v Warn "$LOGS/ab_t1.log" | tail -n 14 >>"$SUMMARY"
      ;;
    tailprof)  # Kimi T9 B1 profiled as planned and with the tail launch forced (both grids on one time axis):
               # does the tail grid start beside the first, and what does a tile cost two XR_ONLY CTAs to an SM?
      stage prof_t9 timeout 200 python3 scripts/f90_profile.py tail
      grep -v Warn "$LOGS/prof_t9.log" | tail -n 24 >>"$SUMMARY"
      KDTR_FLASH_TAIL=1 stage prof_t9_tail timeout 200 python3 scripts/f90_profile.py tail
      grep -v Warn "$LOGS/prof_t9_tail.log" | tail -n 40 >>"$SUMMARY"
      stage prof_pertoken timeout 200 python3 scripts/f90_profile.py pertoken
      grep -v Warn "$LOGS/prof_pertoken.log" | tail -n 36 >>"$SUMMARY"
      ;;
    knobs)  # experiment builds of flash-sm90: ci first (a wrong build's timings do not count), then profile and timings
      IFS=';' read -ra KV <<<"${KNOBS:-base=}"
      if ! stage knob_verify timeout 240 python3 scripts/knob_verify.py "${KV[@]}"; then
        tail -n 12 "$LOGS/knob_verify.log" >>"$SUMMARY"; note "knob_verify failed: timings skipped"; break
      fi
      grep -v Warn "$LOGS/knob_verify.log" | tail -n 12 >>"$SUMMARY"
      stage knob_profile timeout 240 python3 scripts/f90_profile.py "${KV[@]}"
      grep -v Warn "$LOGS/knob_profile.log" | tail -n 80 >>"$SUMMARY"
      stage knob_ablate timeout 240 python3 scripts/sm90_ablate.py default "${KV[@]}"
      grep -v Warn "$LOGS/knob_ablate.log" | tail -n 60 >>"$SUMMARY"
      ;;
    wgmma)  # how fast flash-sm90's wgmma chains run on the tensor pipe, alone and together
      stage wgmma_probe timeout 120 python3 scripts/wgmma_probe.py
      grep -v Warn "$LOGS/wgmma_probe.log" | tail -n 10 >>"$SUMMARY"
      ;;
    ncu)  # stall reasons and pipe use of flash-sm90 (one launch) on a compute and a memory shape
      for shape in "deepseek-v3 8 256 32768 1" "kimi-k2 8 0 32768 32"; do
        tag=$(echo $shape | cut -d' ' -f1,3 | tr ' ' _)
        stage ncu_$tag timeout 240 ncu --clock-control none -k regex:flash90 -s 2 -c 1 \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active.ratio,regex:sm__pipe_tensor.*cycles_active.avg.pct_of_peak_sustained_active,sm__throughput.avg.pct_of_peak_sustained_elapsed,lts__throughput.avg.pct_of_peak_sustained_elapsed,l1tex__throughput.avg.pct_of_peak_sustained_elapsed,smsp__issue_active.avg.pct_of_peak_sustained_active,gpu__time_duration.sum" \
          python3 scripts/run_once.py flash-sm90 $shape
        echo "== $tag" >>"$SUMMARY"
        grep -E "^ +[a-z_]+__" "$LOGS/ncu_$tag.log" | awk '{print $NF, $1}' | sort -rn | head -n 14 >>"$SUMMARY"
      done
      ;;
    probe)  # does racecheck understand named-barrier hand-offs? then flash-sm90 under racecheck, with source lines
      san=$(python3 -c "from kdtr.check.isolate import find_sanitizer as f; print(f() or 'compute-sanitizer')")
      for m in none sync arrive pingpong flash; do
        timeout 60 "$san" --tool racecheck python3 scripts/racecheck_probe.py $m >"$LOGS/probe_$m.log" 2>&1
        note "probe $m: $(grep -E 'RACECHECK SUMMARY|out\[' "$LOGS/probe_$m.log" | tr '\n' ' ')"
      done
      stage san_sm90_racecheck timeout 120 $KDTR verify -k flash-sm90 ci --sanitize racecheck --json "$LOGS/san_sm90_rc.json"
      python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['results']; print('\n'.join(sorted({x['message'][:900] for x in r if x['status']=='SANITIZER'})))" \
        "$LOGS/san_sm90_rc.json" >>"$SUMMARY"
      ;;
    ncusrc)  # per-SASS-instruction stall samples of one flash-sm90 launch (compute shape, memory shape)
      for shape in "deepseek-v3 8 256 32768 1" "kimi-k2 8 4 32768 32"; do
        tag=$(echo $shape | cut -d' ' -f1,3 | tr ' ' _)
        stage ncusrc_$tag timeout 200 ncu --clock-control none -k regex:flash90 -s 2 -c 1 --section SourceCounters \
          --section WarpStateStats --section SpeedOfLight -f -o "$LOGS/ncu_$tag" python3 scripts/run_once.py flash-sm90 $shape
        ncu -i "$LOGS/ncu_$tag.ncu-rep" --page source --csv --print-source sass >"$OUT/ncusrc_$tag.csv" 2>"$LOGS/ncusrc_$tag.err" \
          || note "ncu --page source failed: $(head -c 300 "$LOGS/ncusrc_$tag.err")"
        ncu -i "$LOGS/ncu_$tag.ncu-rep" --page details --csv >"$LOGS/ncu_details_$tag.csv" 2>&1
        note "$tag: $(wc -l <"$OUT/ncusrc_$tag.csv") source rows"
      done
      ;;
    ncuxonly)  # what bounds an XR_ONLY tile two CTAs to an SM (docs/PERF.md, session 14's next step): per-instruction
               # stall samples of XR_ONLY (Kimi T1 P128k B32 as planned, B1 forced) beside the 64-row build's B1
      # pipe and shared-memory bank use: only the counters this ncu knows (a missing name fails the whole profile)
      NCUX_METRICS=$(ncu --query-metrics 2>/dev/null | awk '{print $1}' \
        | grep -E '^(sm__pipe_tensor_op_gmma_cycles_active|sm__pipe_shared_cycles_active|l1tex__data_bank_reads|l1tex__data_bank_writes|smsp__issue_active)$' \
        | sed 's/$/.avg.pct_of_peak_sustained_active/' | paste -sd, -)
      note "ncu metrics: ${NCUX_METRICS:-none found}"
      NCUX_METRICS=${NCUX_METRICS:-smsp__issue_active.avg.pct_of_peak_sustained_active}
      for case in "xonly_b32||kimi-k2 8 0 131072 32" "xonly_b1|KDTR_FLASH_XR=1|kimi-k2 8 0 131072 1" \
                  "rows64_b1||kimi-k2 8 0 131072 1"; do
        IFS='|' read -r tag envs shape <<<"$case"
        stage ncux_$tag env $envs timeout 200 ncu --clock-control none -k regex:flash90 -s 2 -c 1 --section SourceCounters \
          --section WarpStateStats --section SpeedOfLight --metrics "$NCUX_METRICS" -f -o "$LOGS/ncux_$tag" \
          python3 scripts/run_once.py flash-sm90 $shape
        ncu -i "$LOGS/ncux_$tag.ncu-rep" --page details --csv 2>/dev/null \
          | grep -E 'Throughput|Duration|gmma|bank|issue_active|SM Frequency' | awk -F'","' '{print $(NF-2), $NF}' >>"$SUMMARY"
        ncu -i "$LOGS/ncux_$tag.ncu-rep" --page source --csv --print-source sass >"$OUT/ncux_$tag.csv" 2>"$LOGS/ncux_$tag.err" \
          || note "ncu --page source failed: $(head -c 300 "$LOGS/ncux_$tag.err")"
        echo "== $tag ($envs $shape)" >>"$SUMMARY"
        python3 scripts/ncu_stalls.py "$OUT/ncux_$tag.csv" 12 >>"$SUMMARY" 2>&1
      done
      ;;
    narrow)  # the narrow combine (session 15): ci, every flash test, the sanitizer tests of flash and flash-sm90
             # (the 8-row goldens through XR_ONLY and the narrow combine), Kimi T1 timings against the 64-row build, the sweep
      ci_verify flash flash-sm90
      flash_tests
      flash_san_tests
      stage ablate_narrow python3 scripts/sm90_ablate.py t1narrow base= rows64=KDTR_FLASH_XR=0 base2=
      grep -vE "^$" "$LOGS/ablate_narrow.log" | tail -n 17 >>"$SUMMARY"
      bench_sets
      ;;
    flashnarrow)  # `flash` (mma.sync) with the narrow combine: sanitizers on ci with it forced, Kimi decode timed
                  # as planned and with the 128-column combine; flash-sm90's T5 B1 merge options
      KDTR_FLASH_COMBINE=narrow sanitize_ci flash
      flash_combine_timings 0 plan split plan2
      stage ablate_t5 timeout 200 python3 scripts/sm90_ablate.py t15 base= narrow=KDTR_FLASH_COMBINE=narrow \
        merge2=KDTR_FLASH_MERGE=2 narrow64=KDTR_FLASH_COMBINE=narrow64 base2=
      grep -vE "^$" "$LOGS/ablate_t5.log" | tail -n 29 >>"$SUMMARY"
      ;;
    abtree2)  # ab_old/ against this tree twice, interleaved: flash-sm90 on $AB_SHAPES (default balance), flash on Kimi decode
      ab_interleaved "${AB_SHAPES:-balance}"
      ;;
    rowsparts)  # session 17: the warp-per-row merge by half rows past 4 splits: ci, the merge tests, the flash sanitizer
                # tests, then ab_old/ against this tree twice, interleaved, on the DeepSeek launches whose merge it changes
      ci_verify flash flash-sm90
      stage pytest_merges timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_verify.py -k "combine or merges"
      tail -n 2 "$LOGS/pytest_merges.log" >>"$SUMMARY"
      flash_san_tests
      ab_interleaved rowsparts
      ;;
    promotion)  # session 18: the cache map's 128-byte L2 promotion: ci, the sweep, flash-sm90's GPU tests (not the long suite)
      ci_verify flash-sm90
      bench_sets
      stage pytest_sm90 timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_verify.py -k "sm90 and not long and (tensor_map or transposed or narrow)"
      tail -n 2 "$LOGS/pytest_sm90.log" >>"$SUMMARY"
      ;;
    sfirst)  # session 19: S(i+1) issued before P(i) is handed over (-DKDTR_F90_S_FIRST=1), at 2 stages and at 3 (above
             # 99 KB: what the stage count costs the tile chain): ci for each, interleaved timings, per-section profile
      SF2="sf2=-DKDTR_F90_S_FIRST=1"; S3="s3=-DKDTR_F90_STAGES=3 -DKDTR_F90_EXPERIMENT"
      SF3="sf3=-DKDTR_F90_S_FIRST=1 -DKDTR_F90_STAGES=3 -DKDTR_F90_EXPERIMENT"
      SF4="sf4=-DKDTR_F90_S_FIRST=1 -DKDTR_F90_STAGES=4 -DKDTR_F90_EXPERIMENT"
      if ! stage knob_verify timeout 300 python3 scripts/knob_verify.py "$SF2" "$SF3" "$SF4"; then
        tail -n 12 "$LOGS/knob_verify.log" >>"$SUMMARY"; note "knob_verify failed: timings skipped"; break
      fi
      grep -v Warn "$LOGS/knob_verify.log" | tail -n 6 >>"$SUMMARY"
      stage sf_ablate timeout 360 python3 scripts/sm90_ablate.py sfirst base= "$SF2" "$S3" "$SF3" "$SF4" base2= "${SF3/sf3=/sf3again=}"
      grep -v Warn "$LOGS/sf_ablate.log" | tail -n 110 >>"$SUMMARY"
      stage sf_profile timeout 200 python3 scripts/f90_profile.py default base= "$SF2" "$SF3"
      grep -E "CTAs, |^  (producer|consumer|per CTA)" "$LOGS/sf_profile.log" | cut -c1-220 | head -n 80 >>"$SUMMARY"
      ;;
    qskip)  # session 20: does Q's two-round load gate the first S? Q_SKIP builds load 2 or 16 of Q's 32 chunks a thread
            # (wrong results, timing only) against the shipped build; profiles say when the first tile is waited past
      QS1="qs1=-DKDTR_F90_Q_SKIP=1"; QS8="qs8=-DKDTR_F90_Q_SKIP=8"
      stage qs_ablate timeout 300 python3 scripts/sm90_ablate.py qload base= "$QS1" "$QS8" base2=
      grep -v Warn "$LOGS/qs_ablate.log" | tail -n 40 >>"$SUMMARY"
      stage qs_profile timeout 200 python3 scripts/f90_profile.py tail base= "$QS1"
      grep -E "CTAs, |^  (producer|consumer|per CTA)|prologue|launch" "$LOGS/qs_profile.log" | cut -c1-220 | head -n 60 >>"$SUMMARY"
      ;;
    noop)  # session 20: how far apart builds of the same code time: the shipped build against three compiled with an unused
           # -D (their own cache entries and modules; the cubins byte-identical on the H200: `placement`, run 7)
      stage noop_ablate timeout 400 python3 scripts/sm90_ablate.py partials base= noop1=-DKDTR_NOOP=1 noop2=-DKDTR_NOOP=2 \
        base2= noop3=-DKDTR_NOOP=3
      grep -v Warn "$LOGS/noop_ablate.log" | tail -n 75 >>"$SUMMARY"
      ;;
    loadorder)  # session 20, after noop: is it the load order? the same builds with a no-op build loaded first, and the
                # register stores between them (run 5 timed the row stores there, before they became the default)
      stage order_ablate timeout 400 python3 scripts/sm90_ablate.py partials noop1=-DKDTR_NOOP=1 base= threads=-DKDTR_F90_ROW_STORES=0 \
        noop2=-DKDTR_NOOP=2 noop1again=-DKDTR_NOOP=1
      grep -v Warn "$LOGS/order_ablate.log" | tail -n 75 >>"$SUMMARY"
      ;;
    rowstores)  # session 20: the row stores as the default: against the old stores, each build in a process of its own
                 # (sm90_ablate --apart), then ci, flash-sm90's GPU tests and the sanitizers on ci
      stage apart_ablate timeout 240 python3 scripts/sm90_ablate.py partials --apart rows= threads=-DKDTR_F90_ROW_STORES=0
      grep -v Warn "$LOGS/apart_ablate.log" | tail -n 40 >>"$SUMMARY"
      ci_verify flash-sm90
      stage pytest_sm90 timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_verify.py -k "sm90 and not long"
      tail -n 2 "$LOGS/pytest_sm90.log" >>"$SUMMARY"
      sanitize_ci flash-sm90
      ;;
    tau)  # session 21: the running maximum kept within TAU (-DKDTR_F90_RESCALE_TAU): ci and margins, then each build apart
      stage knob_verify timeout 200 python3 scripts/knob_verify.py tau2=-DKDTR_F90_RESCALE_TAU=2 tau1=-DKDTR_F90_RESCALE_TAU=1
      grep -v Warn "$LOGS/knob_verify.log" | tail -n 6 >>"$SUMMARY"
      stage apart_ablate timeout 400 python3 scripts/sm90_ablate.py partials --apart base= tau1=-DKDTR_F90_RESCALE_TAU=1 \
        tau2=-DKDTR_F90_RESCALE_TAU=2 tau3=-DKDTR_F90_RESCALE_TAU=3 tau8=-DKDTR_F90_RESCALE_TAU=8
      grep -v Warn "$LOGS/apart_ablate.log" | tail -n 70 >>"$SUMMARY"
      ;;
    partials)  # session 22: the splits' partial rows in the output's type (-DKDTR_PARTIAL_AS_OUT: bf16 out, half the bytes
               # of the partials' round trip, now as whole-row stores): ci and margins, then each build apart
      stage knob_verify timeout 200 python3 scripts/knob_verify.py pb=-DKDTR_PARTIAL_AS_OUT
      grep -v Warn "$LOGS/knob_verify.log" | tail -n 4 >>"$SUMMARY"
      stage apart_ablate timeout 400 python3 scripts/sm90_ablate.py partials --apart base= pb=-DKDTR_PARTIAL_AS_OUT
      grep -v Warn "$LOGS/apart_ablate.log" | tail -n 45 >>"$SUMMARY"
      ;;
    earlyxr)  # session 22: the XR build's early alpha hand-off (the default, EARLY_ALPHA=2) against the alpha beside P
              # (-DKDTR_F90_EARLY_ALPHA=0): ci and margins, the same bits, each build apart on the xr set, then racecheck
              # on ci with transposed rows forced (the shipped build)
      stage knob_verify timeout 200 python3 scripts/knob_verify.py --bits late=-DKDTR_F90_EARLY_ALPHA=0
      grep -v Warn "$LOGS/knob_verify.log" | tail -n 5 >>"$SUMMARY"
      stage apart_ablate timeout 300 python3 scripts/sm90_ablate.py xr --apart base= late=-DKDTR_F90_EARLY_ALPHA=0
      grep -v Warn "$LOGS/apart_ablate.log" | tail -n 40 >>"$SUMMARY"
      KDTR_FLASH_XR=1 stage racecheck_xr timeout 240 $KDTR verify -k flash-sm90 ci --sanitize racecheck --json "$LOGS/rc_xr.json"
      tail -n 2 "$LOGS/racecheck_xr.log" >>"$SUMMARY"
      python3 -c "import json, re, sys
for r in json.load(open(sys.argv[1]))['results']:  # the flash_sm90.cu lines each report names
    print(r['case'][:48], r['status'], sorted(set(re.findall(r'flash_sm90.cu:(\d+)', r['message'] or ''))))" "$LOGS/rc_xr.json" >>"$SUMMARY" 2>&1
      ;;
    halfrescale)  # session 21: the consumers' rescale voted per half warp (-DKDTR_F90_HALF_RESCALE=1): ci, the same bits, each build apart, profile
      stage knob_verify timeout 200 python3 scripts/knob_verify.py --bits half=-DKDTR_F90_HALF_RESCALE=1
      grep -v Warn "$LOGS/knob_verify.log" | tail -n 4 >>"$SUMMARY"
      stage apart_ablate timeout 300 python3 scripts/sm90_ablate.py partials --apart base= half=-DKDTR_F90_HALF_RESCALE=1
      grep -v Warn "$LOGS/apart_ablate.log" | tail -n 40 >>"$SUMMARY"
      stage knob_profile timeout 200 python3 scripts/f90_profile.py small base= half=-DKDTR_F90_HALF_RESCALE=1
      grep -A2 "cycles per tile" "$LOGS/knob_profile.log" | grep -v "^--" >>"$SUMMARY"
      ;;
    placement)  # session 20: are the builds byte-identical compile to compile here, and does a reload move their speed?
      stage build_hashes timeout 200 python3 scripts/build_hashes.py 3
      grep -v Warn "$LOGS/build_hashes.log" | tail -n 6 >>"$SUMMARY"
      reload_spread 6
      ;;
    reload)  # session 21: the shipped build's speed over true reloads of its modules (scripts/reload_spread.py)
      reload_spread "${RELOADS:-12}"
      ;;
    reloaddata)  # session 21: the same over new placements of the inputs and workspace, one load of the modules
      reload_spread "${RELOADS:-12}" --data
      ;;
    capsweep)  # session 19: the whole sweep with the 99 KB cap lifted (3 and 4 stages, S first) against the shipped build
      stage cap_sweep timeout 560 python3 scripts/sm90_ablate.py sweep base= \
        "sf3=-DKDTR_F90_S_FIRST=1 -DKDTR_F90_STAGES=3 -DKDTR_F90_EXPERIMENT" "sf4=-DKDTR_F90_S_FIRST=1 -DKDTR_F90_STAGES=4 -DKDTR_F90_EXPERIMENT"
      grep -v Warn "$LOGS/cap_sweep.log" | tail -n 130 >>"$SUMMARY"
      ;;
    clusters)  # session 19: how many clusters of the main build fit at once, by size (scripts/cluster_fit.py)
      stage cluster_fit timeout 120 python3 scripts/cluster_fit.py
      grep -v Warn "$LOGS/cluster_fit.log" | tail -n 12 >>"$SUMMARY"
      ;;
    speed)  # session 18: a bulk-copy probe's per-SM rates against XR_ONLY's Kimi T1 P128k B1 per-SM loop ends, and the
            # issuer's prologue steps (profile build)
      stage sm_speed timeout 400 python3 scripts/sm_speed.py
      grep -vE "^ +[0-9]+:" "$LOGS/sm_speed.log" | cut -c1-300 >>"$SUMMARY"
      ;;
    narrowwarps)  # session 17: the narrow merge with 4 or 8 warps, one wave: ci, flash tests, flash sanitizer tests, then
                  # ab_old/ against this tree twice, interleaved, on the decode shapes whose merge it picks
      ci_verify flash flash-sm90
      flash_tests
      flash_san_tests
      ab_interleaved narrowwarps
      ;;
    narrow64)  # the narrow combine's 64-column chunks on 16-80 rows (session 16): ci, every flash test, the flash
               # sanitizer tests, memcheck / racecheck on ci with 64 columns forced, timings against 32 and 128 columns
      ci_verify flash flash-sm90
      flash_tests
      flash_san_tests
      KDTR_FLASH_COMBINE=narrow64 sanitize_ci flash flash-sm90
      stage ablate_n64 timeout 200 python3 scripts/sm90_ablate.py rows16to80 plan= n32=KDTR_FLASH_COMBINE=narrow32 \
        split=KDTR_FLASH_COMBINE=split plan2=
      grep -vE "^$" "$LOGS/ablate_n64.log" | tail -n 51 >>"$SUMMARY"
      flash_combine_timings 0,4,8 plan split
      ;;
    robust)  # crash / trap / hang isolation and compute-sanitizer (tests/test_gpu_isolation.py)
      stage pytest_robust timeout 420 python3 -m pytest -q -rs -s -m gpu -p no:cacheprovider tests/test_gpu_isolation.py
      tail -n 30 "$LOGS/pytest_robust.log" >>"$SUMMARY"
      ;;
    sanitize)  # built-in kernels ($SAN_KERNELS, default all three) under memcheck and racecheck on the ci suite, at once
      sanitize_ci ${SAN_KERNELS:-naive flash flash-sm90}
      ;;
    devices)  # the same small sweep on one GPU and spread over every local GPU (--devices N)
      n=$(nvidia-smi -L | wc -l)
      stage bench_dev1 $KDTR bench -k flash --baselines eager --model kimi-k2 --tp 8 --budget 0,4 --prefix 32k \
        --batch 1,32 --json "$LOGS/bench_dev1.json"
      stage bench_devN $KDTR bench -k flash --baselines eager --model kimi-k2 --tp 8 --budget 0,4 --prefix 32k \
        --batch 1,32 --devices "$n" --json "$LOGS/bench_devN.json"
      note "GPUs: $n"
      python3 scripts/bench_summary.py "$LOGS/bench_dev1.json" "$LOGS/bench_devN.json" >>"$SUMMARY"
      ;;
    mtmem)  # flash row tile 1 / 2 / 4 on the memory set
      for mt in 1 2 4; do
        export KDTR_FLASH_MT=$mt
        stage bench_mem_mt$mt $KDTR bench -k flash --baselines none --set memory --no-check --json "$LOGS/bench_mem_mt$mt.json"
      done
      unset KDTR_FLASH_MT
      python3 scripts/bench_summary.py "$LOGS"/bench_mem_mt*.json >>"$SUMMARY"
      ;;
    mtcmp)  # flash row tile 2 vs 4 on the compute set (KDTR_FLASH_MT forces it)
      for mt in 2 4; do
        export KDTR_FLASH_MT=$mt
        stage bench_mt$mt $KDTR bench -k flash --baselines none --set compute --no-check \
          --json "$LOGS/bench_mt$mt.json"
      done
      unset KDTR_FLASH_MT
      python3 scripts/bench_summary.py "$LOGS"/bench_mt*.json >>"$SUMMARY"
      ;;
    bench)
      stage bench_peaks $KDTR bench --peaks --remeasure
      for set in compute memory; do
        stage bench_$set timeout 400 $KDTR bench -k flash --set $set --json "$LOGS/bench_$set.json"
        python3 scripts/bench_summary.py "$LOGS/bench_$set.json" >>"$SUMMARY"
        cp "$LOGS/bench_$set.json" "$OUT/"
      done
      stage bench_merge python3 scripts/bench_merge.py "$OUT/bench.json" "$OUT/bench.csv" "$OUT/bench.png" \
        "$LOGS/bench_compute.json" "$LOGS/bench_memory.json"
      ;;
    *) note "unknown mode $mode"; exit 2 ;;
  esac
done
tar -czf "$OUT/logs.tgz" -C "$LOGS" .
echo "==================== summary ===================="
cat "$SUMMARY"
