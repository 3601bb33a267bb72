#!/bin/bash
# One device round of helper perf: the parity checks of the changed ops and paths, then
# bench/bench_update.sh. Everything under $OUT; the tables printed last.
D=${D:-.device/perf}
export TANDEM_CACHE=/root/tandem-cache
set -o pipefail
for c in ppo_loss optim swiglu decoder; do
  $D/tandem gpu-test --only $c > $OUT/parity_$c.log 2>&1
  echo "gpu-test --only $c: rc=$? $(grep -cE ' PASS' $OUT/parity_$c.log) pass, $(grep -cE ' FAIL' $OUT/parity_$c.log) fail"
done
$D/tandem gpu-test --time --only swiglu > $OUT/time.log 2>&1; echo "gpu-test --time: rc=$?"
R=/tmp/bench D=$D VARIANTS=1 bash $D/bench_update.sh 2>&1 | tee $OUT/bench.log
tar czf $OUT/bench.tgz -C /tmp/bench .
grep -hE 'FAIL' $OUT/parity_*.log | head -20
