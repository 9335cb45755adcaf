#!/usr/bin/env bash
# Checks the thread-safety annotations (ABSL_GUARDED_BY,
# ABSL_EXCLUSIVE_LOCKS_REQUIRED, ...) with clang's -Wthread-safety: every C++
# file of ours that a build compiles for the CPU, with the flags that build
# uses (its compile_commands.json), through clang++ -fsyntax-only with
# -Wthread-safety -Werror=thread-safety. A thread-safety warning fails the run.
# The CUDA backend (engine/cuda/) is left out: it runs on the GPU's host
# thread, and clang does not parse it with nvcc's headers.
#
# Usage: tools/thread_safety.sh [BUILD_DIR]   (default build/, made by tools/build.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
[[ -f $build/compile_commands.json ]] ||
  { echo "thread-safety: no $build/compile_commands.json (run tools/build.sh first)" >&2; exit 2; }
command -v clang++ >/dev/null ||
  { echo "thread-safety: clang++ not found (tools/install-deps.sh installs clang)" >&2; exit 2; }
exec python3 - "$build" "$(pwd)" "$(nproc)" <<'EOF'
import concurrent.futures, json, os, shlex, subprocess, sys, time

build, root, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3])
start = time.monotonic()
entries = json.load(open(os.path.join(build, "compile_commands.json")))
# GCC-only options clang would not take.
DROP = {"-fno-fat-lto-objects", "-flto=auto", "-ffat-lto-objects"}

def ours(path):
    rel = os.path.relpath(path, root)
    return (rel.endswith(".cc") and not rel.startswith("..") and not rel.startswith("build")
            and not rel.startswith("engine/cuda/"))

def check(entry):
    args = entry.get("arguments") or shlex.split(entry["command"])
    out, skip = ["clang++"], False
    for a in args[1:]:
        if skip:
            skip = False
            continue
        if a == "-o":
            skip = True
            continue
        if a == "-c" or a in DROP:
            continue
        out.append(a)
    out += ["-fsyntax-only", "-Wthread-safety", "-Werror=thread-safety",
            "-Wno-unknown-warning-option"]
    r = subprocess.run(out, cwd=entry["directory"], capture_output=True, text=True)
    return entry["file"], r.returncode, r.stderr

units = [e for e in entries if ours(e["file"])]
seen, unique = set(), []
for e in units:  # a file compiled into two targets is checked once
    if e["file"] not in seen:
        seen.add(e["file"])
        unique.append(e)
failed = []
with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
    for path, rc, err in pool.map(check, unique):
        if rc != 0 or "-Wthread-safety" in err:
            failed.append(os.path.relpath(path, root))
            sys.stderr.write(err)
print("thread-safety: %d files checked in %.0f s, %d with problems"
      % (len(unique), time.monotonic() - start, len(failed)))
if failed:
    print("thread-safety: FAILED: " + " ".join(failed))
    sys.exit(1)
print("thread-safety: every annotation holds")
EOF
