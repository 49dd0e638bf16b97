set -u
R=$(pwd)
bash perf/h200.sh info > /dev/null 2>&1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site-old "$R"/.carry/oldwhl/*.whl || exit 1
ONLY="prefill/d128/B4/S4096,prefill/B1/S16384,prefill/B8/q512,prefill/d64/,prefill/d256/"
export PAGEDATTN_CACHE_DIR=/tmp/pacache PYTHONUNBUFFERED=1
cd /tmp
run() { # tag pythonpath overrides
  PYTHONPATH=$2 python3 -m pagedattn.cli bench --suite sweep --only "$ONLY" --quick --no-report --overrides "$3" --out "$OUT/results/$1" 2>&1 | grep -E "^  prefill" | sed "s/^/$1 /" | cut -c1-150
}
for r in 1 2; do
  run old$r /tmp/site-old:/tmp/site '{}'
  run new40_$r /tmp/site '{}'
  run new24_$r /tmp/site '{"attention": {"tiles": {"prefill_ws": {"kWsProducerRegs": 24}}}}'
done
