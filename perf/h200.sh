#!/usr/bin/env bash
# One call on the H200 (device tool): install from carried wheels, then the stages named in $@
# (info precompile packbundle bundle tests alltests sanitize racecheck wssmoke fuzz fuzzsanitize overhead overheadab sweep benchwrite aotcheck ncu ncusrc
# benchdw benchp benchs benchq bench-full demo kernelab multigpu hfcb aot16 programsass pack).
# Logs and results go under $OUT; RESULTS.md is regenerated here with `pagedattn bench report`.
# Usage there:  PAGEDATTN_GIT_COMMIT=<sha> bash perf/h200.sh info tests overhead bench
# tests: PYTEST_FILES, PYTEST_K, PYTEST_N (xdist workers), PYTEST_ARGS (e.g. "-vv --tb=line": with the -q
# the stage passes, one -v is cancelled out), PYTEST_TIMEOUT seconds (then SIGINT: pytest still prints
# its summary of failures so far), PYTEST_TAG (log name suffix). An interrupted grid continues on the same
# code: run it with PYTEST_ARGS="-vv ..." (one PASSED line per test), carry its log (gzipped) and set
# PAGEDATTN_TEST_SKIP_PASSED=<log> (tests/conftest.py leaves out what it passed; PAGEDATTN_TEST_RERUN=<regex>
# keeps the tests it matches, e.g. those a kernel change since that log touches).
set -uo pipefail
ROOT=$(pwd)
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT/results"
export PYTHONPATH=/tmp/site PAGEDATTN_CACHE_DIR=/tmp/pacache PYTHONUNBUFFERED=1
# FlashAttention-4 as a bench peer when its carry came along (../shared/PEERS.md: .carry/fa4, built by
# build_carry.sh; 50 MiB, so no bundle travels with it): unpacked once per call into /tmp/fa4site
if [ -f "$ROOT/.carry/fa4/install.sh" ]; then
  [ -d /tmp/fa4site ] || bash "$ROOT/.carry/fa4/install.sh" > /dev/null || echo "fa4 carry did not install"
  [ -d /tmp/fa4site ] && export PYTHONPATH=/tmp/site:/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages
fi
# once per tree: later invocations in the same command (e.g. each under its own `timeout`) reuse the
# install; a warm machine's next call (a new tree: another PAGEDATTN_GIT_COMMIT or changed sources)
# installs again (a stale install once ran a whole call on the previous commit's kernels)
tree_id="${PAGEDATTN_GIT_COMMIT:-}:$(cat pyproject.toml templates/*.j2 templates/include/pagedattn/*.cuh pagedattn/*.py pagedattn/*/*.py pagedattn/*/*/*.py 2>/dev/null | sha256sum | cut -c1-16)"
if [ "$(cat /tmp/site/.pagedattn-installed 2>/dev/null)" != "$tree_id" ]; then
  rm -rf /tmp/site
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --upgrade --target /tmp/site . || exit 1
  echo "$tree_id" > /tmp/site/.pagedattn-installed
fi
cd /tmp
# `pagedattn bench ARGS` writing into $OUT/results (RESULTS.md: see above)
bench() { python3 -m pagedattn.cli bench "$@" --no-report --out "${BENCH_OUT:-$OUT/results}"; }
summary=()
for stage in "$@"; do
  t0=$(date +%s)
  case $stage in
    info)      python3 -m pagedattn.cli info ;;
    # logs go to $OUT as they are written (a stage killed by its timeout keeps what it printed)
    tests)     PAGEDATTN_TEST_BUNDLE=${PAGEDATTN_AOT_DIR:-} timeout -s INT -k 30 ${PYTEST_TIMEOUT:-86400} python3 -m pytest -q -ra -m gpu -p no:cacheprovider ${PYTEST_ARGS:-} ${PYTEST_N:+-n "$PYTEST_N"} ${PYTEST_FILES:-"$ROOT/tests"} ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/gpu_tests${PYTEST_TAG:-}.log" 2>&1; rc=$?; tail -n 40 "$OUT/gpu_tests${PYTEST_TAG:-}.log"; (exit $rc) ;;
    alltests)  python3 -m pytest -q -ra -p no:cacheprovider "$ROOT/tests" 2>&1 | tail -n 60 | tee "$OUT/all_tests.log" ;;
    # the kernels compiled first by 12 processes at once (tests/tools/sanitize_cases.py part I/12), then memcheck on the warm cache
    sanitize)  for i in $(seq 0 11); do python3 "$ROOT/tests/tools/sanitize_cases.py" part $i/12 > "$OUT/sanitize_warm_$i.log" 2>&1 & done; wait
               cat "$OUT"/sanitize_warm_*.log > "$OUT/sanitize_warm.log"; rm -f "$OUT"/sanitize_warm_*.log
               compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 "$ROOT/tests/tools/sanitize_cases.py" > "$OUT/sanitize.log" 2>&1; rc=$?; tail -n 30 "$OUT/sanitize.log"; (exit $rc) ;;
    # the warp-specialised prefill under memcheck, racecheck (shared memory) and synccheck (barriers)
    racecheck) rc=0; for tool in memcheck racecheck synccheck; do
                 compute-sanitizer --tool $tool --report-api-errors no --error-exitcode 9 python3 "$ROOT/tests/tools/sanitize_cases.py" ws > "$OUT/$tool.log" 2>&1 || rc=9
                 tail -n 4 "$OUT/$tool.log"
               done; (exit $rc) ;;
    # prefill_ws's opt-in tile fields on small cases, a process per (fields, case) under a time limit: a hang
    # is reported, not waited out (WSSMOKE_ARGS: e.g. "--fields all,chain --cases d128")
    wssmoke)   python3 "$ROOT/tests/tools/ws_opt_in_smoke.py" --jobs 12 --out "$OUT/results" ${WSSMOKE_ARGS:-} 2>&1 | tail -n 50 ;;
    fuzz)      python3 "$ROOT/tests/fuzz/fuzz_metadata.py" --cases ${FUZZ_CASES:-2000} --seed ${FUZZ_SEED:-0} ${FUZZ_ARGS:-} --out "$OUT/results" 2>&1 | tail -n 40 ;;
    fuzzsanitize) PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --report-api-errors no --error-exitcode 9 python3 "$ROOT/tests/fuzz/fuzz_metadata.py" --sanitize ${FUZZ_ARGS:-} --out "$OUT/results" > "$OUT/fuzzsanitize.log" 2>&1; rc=$?; tail -n 25 "$OUT/fuzzsanitize.log"; (exit $rc) ;;
    overhead)  python3 "$ROOT/perf/launch_overhead.py" "$OUT/results" ;;
    # into an ignored folder of the checkout: a later call on the still-warm machine finds it (incremental)
    # adds to the carried bundle when one was extracted (stage bundle), else to an ignored checkout folder
    precompile) export PAGEDATTN_AOT_DIR="${PAGEDATTN_AOT_DIR:-$ROOT/.carry/devbundle}"
               python3 -m pagedattn.cli precompile --arch sm_90a --ops "${PRECOMPILE_OPS:-attn_fwd,kv_write,legacy_attn,legacy_reduce,legacy_cache_write}" ${PRECOMPILE_ARGS:---preset default} --jobs 16 --out "$PAGEDATTN_AOT_DIR" -q 2>&1 | tail -n 15 ;;
    # the bundle as it now stands, back to the CPU machine (carry it in the next call)
    packbundle) tar -C "$(dirname "$PAGEDATTN_AOT_DIR")" -cf - "$(basename "$PAGEDATTN_AOT_DIR")" | xz -T16 -6 > "$OUT/bundle.tar.xz"; ls -la "$OUT/bundle.tar.xz" ;;
    # the default preset cold (recorded: aot_precompile_*.json), built where stage precompile puts it (the
    # later stages use it) when that folder is still empty
    aot16)     export PAGEDATTN_AOT_DIR="${PAGEDATTN_AOT_DIR:-$ROOT/.carry/devbundle}"
               keep=(); [ -e "$PAGEDATTN_AOT_DIR/manifest.json" ] || keep=(--bundle "$PAGEDATTN_AOT_DIR")
               python3 "$ROOT/perf/compile_costs.py" precompile --arch sm_90a --jobs 16 "${keep[@]}" --out "$OUT/results" 2>&1 | tail -n 12 ;;
    # every kernel of the default preset compiled in its NVRTC program against alone: the same SASS?
    programsass) python3 "$ROOT/tests/tools/program_sass.py" --jobs 16 --out "$OUT/results" 2>&1 | tail -n 12 ;;
    benchwrite) bench --suite write --quick ;;
    # the sweeps: `pagedattn bench` once per entry of SWEEP_OVERRIDES (JSON objects separated by ';', each
    # {"attention": pagedattn.ops.attention.forced's arguments, "write": reshape_and_cache_flash's overrides=};
    # default '{}', the library's defaults) over SWEEP_SUITES (default sweep: ours alone at the tile / mode
    # studies' shapes; or write, decode, prefill, features), BENCH_ONLY case id substrings, SWEEP_ARGS more options
    sweep)     IFS=';' read -ra points <<< "${SWEEP_OVERRIDES:-{\}}"
               touch /tmp/sweep_started
               for ov in "${points[@]}"; do
                 bench --suite "${SWEEP_SUITES:-sweep}" ${BENCH_ONLY:+--only "$BENCH_ONLY"} --overrides "$ov" ${SWEEP_ARGS:-}
               done
               # the points side by side (every round of each), last in the call's output
               mapfile -t made < <(find "${BENCH_OUT:-$OUT/results}" -maxdepth 1 -name '*.json' -newer /tmp/sweep_started | sort)
               [ ${#made[@]} -gt 0 ] && python3 -m pagedattn.cli bench ab "${made[@]}" | tee "$OUT/sweep_ab.md" ;;
    bundle)    [ -f /tmp/bundle/manifest.json ] || { mkdir -p /tmp/bundle && tar -xJf "$ROOT/.carry/bundle.tar.xz" -C /tmp/bundle --strip-components=1; }
               export PAGEDATTN_AOT_DIR=/tmp/bundle
               python3 -c "import sys, pathlib; from pagedattn.codegen import bundle; sys.exit(0 if bundle.read_manifest(pathlib.Path('/tmp/bundle')) else 1)" \
                 && echo "carried bundle accepted ($(ls /tmp/bundle/kernels | wc -l) kernels; others compile on first use)" \
                 || echo "carried bundle REJECTED: kernels compile on first use" ;;
    aotcheck)  PAGEDATTN_DISABLE_JIT=1 python3 "$ROOT/tests/tools/aot_check.py" ;;
    ncu)       for k in ${NCU_CASES:-decode}; do
                 ncu --clock-control none --kernel-name regex:"${NCU_KERNELS:-attn_fwd_}" --launch-skip 2 --launch-count ${NCU_COUNT:-1} \
                     --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
                     --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis ${NCU_EXTRA:-} \
                     python3 "$ROOT/perf/profile_case.py" $k > "$OUT/ncu_$k.txt" 2>&1
                 grep -E "Duration|DRAM Throughput|Memory Throughput|Compute \(SM\)|Achieved Occupancy|Registers Per|Stall|Warp Cycles Per Issued" "$OUT/ncu_$k.txt" | head -20
               done ;;
    # ncu's warp-stall samples per SASS instruction of one profile_case.py kind (NCU_CASE, default prefill), as CSV
    ncusrc)    k=${NCU_CASE:-prefill}
               ncu --clock-control none --kernel-name regex:"${NCU_KERNELS:-attn_fwd_}" --launch-skip 2 --launch-count 1 \
                   --section SourceCounters --section WarpStateStats -o /tmp/ncusrc_$k -f python3 "$ROOT/perf/profile_case.py" $k > "$OUT/ncusrc_$k.txt" 2>&1
               ncu -i /tmp/ncusrc_$k.ncu-rep --page source --csv --print-source sass > /tmp/ncusrc_$k.csv
               xz -T8 -c /tmp/ncusrc_$k.csv > "$OUT/ncusrc_$k.csv.xz" ;;
    benchq)    bench --suite all --quick ;;
    benchdw)   bench --suite decode,write --quick ;;
    benchp)    bench --suite prefill --quick ;;
    benchs)    bench --suite "${BENCH_SUITES:-features}" ${BENCH_ONLY:+--only "$BENCH_ONLY"} --quick ;;
    bench-full) bench --suite all ;;
    demo)      python3 -m pagedattn.demo ;;
    # host cost A/B in one call: an older build (a wheel carried in .carry/oldwhl, with its own bundle dirs in
    # OLD_AOT_DIR, and that build's launch_overhead.py when carried there too) against this tree, alternating old / new AB_ROUNDS times (the machine's speed drifts between calls)
    overheadab) old_script="$ROOT/perf/launch_overhead.py"; [ -f "$ROOT/.carry/oldwhl/launch_overhead.py" ] && old_script="$ROOT/.carry/oldwhl/launch_overhead.py"
               python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site-old "$ROOT"/.carry/oldwhl/*.whl || exit 1
               rows="^(raw|flash_attn_decode|reshape|op_flash_attn_decode|torch_add)_.*us "
               for r in $(seq ${AB_ROUNDS:-2}); do
                 PYTHONPATH=/tmp/site-old:/tmp/site PAGEDATTN_AOT_DIR=${OLD_AOT_DIR:-/tmp/bundle} python3 "$old_script" "$OUT/results/ab_old_$r" | grep -E "$rows" | sed "s/^/old$r /"
                 python3 "$ROOT/perf/launch_overhead.py" "$OUT/results/ab_new_$r" | grep -E "$rows" | sed "s/^/new$r /"
               done ;;
    # kernel A/B in one call: the sweep suite (AB_ONLY case ids, default the prefill goal shapes) with an
    # older build (its wheel carried in .carry/oldwhl, e.g. `pip wheel --no-deps` of a worktree) against
    # this tree, alternating AB_ROUNDS times; AB_OVERRIDES adds this tree under those overrides (JSON)
    kernelab)  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site-old "$ROOT"/.carry/oldwhl/*.whl || exit 1
               only=${AB_ONLY:-prefill/d128/B4/S4096,prefill/B1/S16384,prefill/B8/q512,prefill/d64/,prefill/d256/}
               for r in $(seq ${AB_ROUNDS:-2}); do
                 PYTHONPATH=/tmp/site-old:$PYTHONPATH BENCH_OUT=$OUT/results/old$r bench --suite sweep --only "$only" --quick | grep -E "^  prefill" | sed "s/^/old$r /"
                 BENCH_OUT=$OUT/results/new$r bench --suite sweep --only "$only" --quick | grep -E "^  prefill" | sed "s/^/new$r /"
                 [ -z "${AB_OVERRIDES:-}" ] || BENCH_OUT=$OUT/results/ov$r bench --suite sweep --only "$only" --quick --overrides "$AB_OVERRIDES" | grep -E "^  prefill" | sed "s/^/ov$r /"
               done ;;
    # issue 21 on the GPUs of this host (one: a smoke test of the code path)
    multigpu)  torchrun --nproc_per_node=${NGPUS:-$(nvidia-smi -L | wc -l)} "$ROOT/perf/multigpu.py" --out "$OUT/results" 2>&1 | tail -n 15 ;;
    # last: $OUT/results and the logs into one results.tgz (the device gives back at most 8 files, and each
    # sweep point writes a JSON of its own)
    pack)      (cd "$OUT" && tar czf results.tgz results $(ls *.log *.log.gz 2>/dev/null) && rm -rf results *.log *.log.gz; ls "$OUT") ;;
    hfcb)      python3 "$ROOT/perf/hf_continuous_batching.py" --out "$OUT/results" ${HF_ARGS:-} > "$OUT/hf_cb.log" 2>&1; rc=$?; tail -n 25 "$OUT/hf_cb.log"; (exit $rc) ;;
    *)         echo "unknown stage $stage" ;;
  esac
  rc=${PIPESTATUS[0]}
  summary+=("$(printf '%-12s rc=%-3s %4ss' "$stage" "$rc" "$(( $(date +%s) - t0 ))")")
done
echo "==== stages ===="; printf '%s\n' "${summary[@]}"
