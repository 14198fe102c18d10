#!/usr/bin/env bash
# Instructions to read a request body for its model (`inspect_body`, run for every
# request whose path names no Azure deployment), by the length and kind of its prompt: callgrind counts
# crates/spillgate-core/examples/body_scan.rs reading each body ITER times, less the same
# run with an empty prompt, divided by ITER. The count repeats from run to run.
#
#   bench/body.sh                # prompts of 20,000 bytes: plain, escapes, ja
#   BYTES=100000 bench/body.sh   # longer prompts
#   SMOKE=1 bench/body.sh        # seconds, no callgrind: each body read once (./test.sh)
#
# Installs valgrind with apt-get when missing. Prints a markdown table: the body's
# length, the instructions a read, and the instructions a byte of prompt.
set -euo pipefail
# A failed read (valgrind, or body_scan not finding the model) fails the script, not
# just the command substitution it runs in.
shopt -s inherit_errexit
cd "$(dirname "${BASH_SOURCE[0]}")/.."
ROOT=$PWD
. bench/lib.sh

BYTES=${BYTES:-20000}
ITER=${ITER:-200}
TEXTS=(plain escapes ja)
if [[ -n ${SMOKE:-} ]]; then
    cargo build -q -p spillgate-core --example body_scan
    BIN=${CARGO_TARGET_DIR:-$ROOT/target}/debug/examples/body_scan
    for text in "${TEXTS[@]}"; do
        "$BIN" 2000 "$text" 1 >/dev/null
    done
    echo "body.sh: smoke run read every kind of body"
    exit 0
fi
need valgrind valgrind
cargo build -q --release -p spillgate-core --example body_scan
BIN=${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/body_scan

# count <prompt bytes> <text>: "body_bytes instructions" of one run of ITER reads.
count() {
    local out="$WORK/cg.$1.$2" len
    len=$(valgrind --tool=callgrind --callgrind-out-file="$out" "$BIN" "$1" "$2" "$ITER" 2>/dev/null | cut -d' ' -f1)
    echo "$len $(callgrind_annotate "$out" 2>/dev/null | awk '/PROGRAM TOTALS/ {gsub(",", "", $1); print $1}')"
}

echo "| prompt | body bytes | instructions a read, for the prompt | a byte of prompt |"
echo "|---|---:|---:|---:|"
for text in "${TEXTS[@]}"; do
    empty=$(count 0 "$text")
    full=$(count "$BYTES" "$text")
    read -r _ base <<<"$empty"
    read -r len total <<<"$full"
    awk -v t="$text" -v len="$len" -v a="$total" -v b="$base" -v n="$ITER" -v p="$BYTES" \
        'BEGIN {r = (a - b) / n; printf "| %s | %d | %.0f | %.2f |\n", t, len, r, r / p}'
done
