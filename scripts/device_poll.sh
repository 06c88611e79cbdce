#!/usr/bin/env bash
# Beside a detached scripts/device_run.sh (RESULTS=/tmp/res ... setsid scripts/device_run.sh &): prints its progress and
# packs its logs into one tarball under $OUT, which the device tool brings back (it brings at most 8 files, and
# empties $OUT before each command). Poll within ~30 s of the last command, or the machine goes back.
R="${RESULTS:-/tmp/res}"
cat "$R/progress" 2>/dev/null
ls "$R" 2>/dev/null | tr '\n' ' '
echo
if [ -n "${OUT:-}" ] && [ -d "$R" ]; then
  tar czf "$OUT/results.tgz" -C "$(dirname "$R")" "$(basename "$R")"
fi
