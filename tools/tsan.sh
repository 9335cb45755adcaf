#!/usr/bin/env bash
# Builds everything that runs on the CPU with ThreadSanitizer into
# build-tsan/, and runs under it the tests of the code that has threads: the
# batcher, service and common unit tests and the end-to-end tests, the
# instrumented server under its Python clients (the ctest label "tsan").
# A data race, a lock-order inversion or any other TSan report, in a test
# binary or in a server that the Python tests started, fails the run.
#   tools/tsan.sh [ctest arguments]
#
# Abseil: our code, gRPC and gpr all synchronize with absl::Mutex, whose
# atomics and futexes TSan cannot see unless Abseil itself is built with
# -fsanitize=thread (its Mutex then tells TSan what it does); Debian's is not.
# So Debian's own source of the installed Abseil is fetched (apt-get source,
# with a source list of our own) and its synchronization libraries (Mutex,
# CondVar, Notification, SpinLock, call_once and what they use inside) are
# built with TSan as shared libraries with Debian's sonames, inline namespace
# and C++ standard, into build-tsan/absl/lib, once (kept for later runs;
# about 30 s on 2 cores). The test binaries are linked with an RPATH to
# that folder, which the dynamic loader also follows for the Abseil
# dependencies of libgrpc and libgpr, so one instrumented Mutex serves all.
# LD_LIBRARY_PATH is not used: it would also reach the Python of the
# end-to-end tests, whose grpcio loads Debian's Abseil too, uninstrumented.
# The rest of Abseil (Status, Cord, strings...) stays Debian's, uninstrumented
# like gRPC, protobuf and prometheus-cpp: TSan checks the memory accesses of
# our code (and of the library templates compiled into it) and sees the
# synchronization of everything. Interceptors called from uninstrumented
# code (memcpy, free...) are not counted as accesses
# (ignore_noninstrumented_modules). The one ordering that gRPC core provides
# with its own atomics, a batch's start before its completion, is shown to
# TSan by tools/tsan_grpc.c, linked into the test binaries. tools/tsan.supp
# lists the few reports inside third-party code that remain, each with its
# reason.
#
# The end-to-end tests that bound the server's memory (RSS within 32 MiB of
# its idle size) are left out: TSan's shadow memory and per-thread state make
# such bounds meaningless; the plain and ASan runs check them.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
build=build-tsan
python=${COALESCE_PYTHON:-$(tools/make-venv.sh build/venv)}
jobs=$(nproc)
t0=$SECONDS

# --- Abseil's synchronization, instrumented ---------------------------------
absl=$root/$build/absl
absl_flags="-O2 -g1 -fsanitize=thread"
# The libraries built with TSan; every other libabsl_* stays Debian's. Each
# one that takes an absl SpinLock must be among them: SpinLock::Lock is
# inline, and an uninstrumented caller (Debian's libabsl_time, whose Now()
# takes one on its slow path) entering the instrumented SlowLock breaks
# TSan's own bookkeeping ("CHECK failed: ... ignore_sync"). Those are time
# (clock.cc), cordz_info and cordz_handle, and random_internal_pool_urbg.
absl_libs=(synchronization graphcycles_internal malloc_internal base spinlock_wait time cordz_info
           cordz_handle random_internal_pool_urbg)
absl_version=$(dpkg-query -W -f='${source:Version}' libabsl-dev)
stamp="abseil $absl_version; CXXFLAGS $absl_flags; C++17; shared; ${absl_libs[*]}"
multiarch=$(gcc -print-multiarch)
if [[ ! -f $absl/stamp || $(<"$absl/stamp") != "$stamp" ]]; then
  echo "tsan: building Abseil $absl_version (${absl_libs[*]}) with -fsanitize=thread into $absl"
  rm -rf "$absl"
  mkdir -p "$absl/apt/lists/partial" "$absl/apt/cache/archives/partial" "$absl/dl"
  # A one-off source list and package state of our own: the machine's apt
  # configuration is neither read nor changed.
  cat >"$absl/apt/sources.list" <<'EOF'
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm-updates main
deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian-security bookworm-security main
EOF
  apt=(apt-get -q -o "Dir::Etc::sourcelist=$absl/apt/sources.list" -o Dir::Etc::sourceparts=-
       -o "Dir::State::Lists=$absl/apt/lists" -o "Dir::Cache=$absl/apt/cache")
  [ "$(id -u)" -ne 0 ] || apt+=(-o APT::Sandbox::User=root)
  "${apt[@]}" update >"$absl/fetch.log" 2>&1 || { cat "$absl/fetch.log"; exit 1; }
  (cd "$absl/dl" &&
   { "${apt[@]}" source --download-only "abseil=$absl_version" ||
     { echo "tsan: abseil $absl_version is no longer in the archive; taking bookworm's" >&2
       "${apt[@]}" source --download-only abseil; }; }) >>"$absl/fetch.log" 2>&1 ||
    { cat "$absl/fetch.log"; exit 1; }
  # apt checked the files against the archive's signed index; dpkg-source
  # would warn that it has no keyring to check the .dsc's own signature.
  dpkg-source -x "$absl"/dl/abseil_*.dsc "$absl/src" >>"$absl/fetch.log" 2>&1 ||
    { cat "$absl/fetch.log"; exit 1; }
  # The headers we compile against (/usr/include/absl) must be exactly this
  # source's: same version, same Debian patches (options.h: the debian3 inline
  # namespace, no std:: aliases, hardened).
  differ=$(cd /usr/include && find absl -type f | while read -r f; do
             cmp -s "$f" "$absl/src/$f" || echo "$f"; done)
  if [[ -n $differ ]]; then
    echo "tsan: Debian's Abseil source differs from /usr/include/absl:" $differ >&2
    exit 1
  fi
  # As debian/rules builds it (C++17, shared, no NDEBUG), plus TSan.
  cmake -S "$absl/src" -B "$absl/build" -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_STANDARD=17 \
    -DBUILD_SHARED_LIBS=ON -DBUILD_TESTING=OFF -DCMAKE_CXX_FLAGS="$absl_flags" \
    -DCMAKE_SHARED_LINKER_FLAGS="-fsanitize=thread" >"$absl/build.log" 2>&1 ||
    { cat "$absl/build.log"; exit 1; }
  cmake --build "$absl/build" -j "$jobs" --target "${absl_libs[@]}" >>"$absl/build.log" 2>&1 ||
    { tail -50 "$absl/build.log"; exit 1; }
  # Each one takes the place of Debian's: same soname, and at least the same
  # strong exported symbols.
  mkdir -p "$absl/lib"
  soname() { readelf -d "$1" | sed -n 's/.*SONAME.*\[\(.*\)\]/\1/p'; }
  strong() { nm -D --defined-only "$1" | awk '$2 !~ /[WVuw]/ { print $3 }' | sort; }
  for lib in "${absl_libs[@]}"; do
    sys=$(ls /usr/lib/"$multiarch"/libabsl_"$lib".so.* | grep -E '\.so\.[0-9]+$')
    ours=$(find "$absl/build" -name "$(basename "$sys")")
    [[ -n $ours ]] || { echo "tsan: $sys was not built" >&2; exit 1; }
    [[ $(soname "$ours") == "$(soname "$sys")" ]] ||
      { echo "tsan: the soname of $ours differs from $sys's" >&2; exit 1; }
    missing=$(comm -13 <(strong "$ours") <(strong "$sys"))
    [[ -z $missing ]] || { echo "tsan: $ours lacks symbols of $sys: $missing" >&2; exit 1; }
    cp -L "$ours" "$absl/lib/"
  done
  echo "$stamp" >"$absl/stamp"
  echo "tsan: Abseil built in $((SECONDS - t0)) s"
fi
t1=$SECONDS

# --- Our code, instrumented, linked to find that Abseil first ---------------
# tools/tsan_grpc.c, linked into every binary, shows TSan the ordering that
# gRPC core guarantees between starting a batch and its completion (named by
# its source's hash, so that a change to it relinks everything).
mkdir -p "$build"
shim=$root/$build/tsan_grpc-$(sha1sum tools/tsan_grpc.c | cut -c1-12).o
[[ -f $shim ]] || cc -O2 -g -fsanitize=thread -Wall -Wextra -Werror -c tools/tsan_grpc.c -o "$shim"
# --disable-new-dtags: an RPATH (unlike a RUNPATH) also serves the
# dependencies of the libraries, here libgrpc's and libgpr's on Abseil.
link="-fsanitize=thread -Wl,--disable-new-dtags -Wl,-rpath,$absl/lib $shim"
# -g1: line tables are all ThreadSanitizer's reports need, and compile faster.
cmake -S . -B "$build" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOALESCE_CUDA=OFF \
  -DCMAKE_CXX_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" -DCMAKE_C_FLAGS_RELWITHDEBINFO="-O2 -g1 -DNDEBUG" \
  -DCOALESCE_PYTHON="$python" \
  -DCMAKE_CXX_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
  -DCMAKE_C_FLAGS="-fsanitize=thread -fno-omit-frame-pointer" \
  -DCMAKE_EXE_LINKER_FLAGS="$link" -DCMAKE_SHARED_LINKER_FLAGS="$link" >/dev/null
# Only what the tests labelled tsan run: the server, the command-line clients
# (test_samples_e2e.py and test_tls_e2e.py run the CLI, test_tenants_e2e.py
# all three) and three unit-test binaries.
cmake --build "$build" -j "$jobs" --target coalesce-server coalesce-cli coalesce-bench coalesce-eval \
  batcher_tests service_tests common_tests
t2=$SECONDS
# The instrumented Abseil libraries are the ones the test binaries load.
for bin in coalesce-server batcher_tests service_tests common_tests; do
  loaded=$(ldd "$build/bin/$bin")
  for lib in "${absl_libs[@]}"; do
    # Each of them that the binary loads at all must be ours.
    line=$(grep "libabsl_$lib\.so" <<<"$loaded" || true)
    [[ -n $line ]] || continue
    if ! grep -q "=> $absl/lib/" <<<"$line"; then
      echo "tsan: $bin does not load libabsl_$lib from $absl/lib:" >&2
      echo "$line" >&2
      exit 1
    fi
  done
  grep -q "libabsl_synchronization\.so.* => $absl/lib/" <<<"$loaded" ||
    { echo "tsan: $bin does not load the instrumented libabsl_synchronization" >&2; exit 1; }
done

# --- The tests ---------------------------------------------------------------
# Reports go to files, one per process (log_path), so that a report in a
# server started by the Python tests fails the run even where the test does
# not look at the server's exit status (66 after a report).
reports=$root/$build/tsan-reports
rm -rf "$reports"
mkdir -p "$reports"
export TSAN_OPTIONS="suppressions=$root/tools/tsan.supp log_path=$reports/tsan exitcode=66 ignore_noninstrumented_modules=1 second_deadlock_stack=1"
# The hostile tests' 3.9 MB texts a quarter as long: the instrumented
# tokenizer takes seconds for that already, and minutes for the whole.
export COALESCE_E2E_BIG_TEXT_BYTES=975000
export PYTEST_ADDOPTS="-k 'not test_overload_is_refused_fast_and_admitted_work_completes and not test_compressed_request_is_refused_before_it_is_inflated'"
status=0
(cd "$build" && ctest --output-on-failure -j "$jobs" -L '^tsan$' "$@") || status=$?
t3=$SECONDS
echo "tsan: Abseil $((t1 - t0)) s, build $((t2 - t1)) s, tests $((t3 - t2)) s"
shopt -s nullglob
logs=("$reports"/tsan.*)
if ((${#logs[@]})); then
  for f in "${logs[@]}"; do
    echo "==== $f"
    cat "$f"
  done
  echo "tsan: $(cat "${logs[@]}" | grep -c '^WARNING: ThreadSanitizer') report(s) from" \
       "${#logs[@]} process(es), kept in $reports" >&2
  exit 1
fi
((status == 0)) || exit "$status"
echo "tsan: no data race or other ThreadSanitizer report"
