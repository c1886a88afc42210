#!/bin/bash
# The lesson tests N times (default 10) while the rest of the suite runs over and over beside them, each with one
# torch thread as `make test`'s two lanes have: does a lesson's outcome hold on a machine the other lane keeps busy?
#     bash tools/lesson_tests_beside_suite.sh [N] [OUT_DIR]      # prints one line a run; logs in OUT_DIR
cd "$(dirname "$0")/.." || exit 1
runs=${1:-10}; out=${2:-$(mktemp -d)}
mkdir -p "$out"; rm -f "$out/done"
export WATCHLLM_TEST_THREADS=1 OMP_NUM_THREADS=1 GRADIO_ANALYTICS_ENABLED=False
(n=0; while [ ! -f "$out/done" ]; do n=$((n+1))
   timeout 1200 python -m pytest -q -p no:cacheprovider tests/ --ignore=tests/test_lessons.py \
     --ignore=tests/test_e2e_lessons.py -m "not slow" > "$out/other-$n.log" 2>&1
   echo "the rest of the suite, pass $n: exit $?, $(tail -1 "$out/other-$n.log")"; done) &
failed=0
for i in $(seq 1 "$runs"); do
  timeout 1200 python -m pytest -q -p no:cacheprovider tests/test_lessons.py tests/test_e2e_lessons.py \
    > "$out/run-$i.log" 2>&1 || failed=$((failed+1))
  echo "lesson tests, run $i: $(tail -1 "$out/run-$i.log") (load $(cut -d' ' -f1 /proc/loadavg))"
done
touch "$out/done"; wait
echo "lesson tests: $((runs - failed)) of $runs runs passed (logs in $out)"
[ "$failed" -eq 0 ]
