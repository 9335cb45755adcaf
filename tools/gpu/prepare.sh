#!/usr/bin/env bash
# Fills .gpucheck/ (ignored by git) with what a bare GPU machine lacks to build
# and test the engine alone, and to run the server (tools/gpu/check.sh): run it
# here, on a Debian 12 development machine with tools/install-deps.sh's
# packages and a CUDA build in build/ (tools/build.sh), then send the working
# tree with .gpucheck/ to the GPU machine.
#
#   .gpucheck/models/stories260K   the test model, from $COALESCE_MODELS_DIR
#                                  (default ../shared/models)
#   .gpucheck/googletest           googletest's sources (Debian's googletest),
#                                  built there: -DCOALESCE_GTEST_SOURCE=...
#   .gpucheck/absl                 an Abseil prefix: Debian's headers, shared
#                                  libraries and CMake package, relocated:
#                                  -DCMAKE_PREFIX_PATH=...
#   .gpucheck/nlohmann_json        nlohmann-json (headers only), for the tests
#                                  that read JSON goldens; also a prefix
#   .gpucheck/server               the server, built here: bin/ holds
#                                  coalesce-server, coalesce-bench and
#                                  coalesce-loop-bench as scripts that run
#                                  libexec/'s binaries with lib/ (every library
#                                  they load but glibc's own and the CUDA
#                                  driver's) and the machine's CUDA libraries
#                                  (cuBLAS) on LD_LIBRARY_PATH
#   .gpucheck/e2e.desc             the gRPC API's descriptors, from which the
#                                  end-to-end tests build their messages there
#                                  (no protoc on that machine)
#   .gpucheck/COMMIT               the commit (and whether the tree differs)
#
# The Abseil libraries are Debian 12's (glibc 2.36, GCC 12): they run on any
# newer x86-64 glibc and libstdc++. Binaries built against them find them
# through the RPATH that CMake writes into the build tree.
set -euo pipefail
cd "$(dirname "$0")/../.."
root=$PWD
dest=$root/.gpucheck
models=${COALESCE_MODELS_DIR:-$root/../shared/models}
gtest_src=${COALESCE_GTEST_SOURCE:-/usr/src/googletest}
multiarch=$(gcc -print-multiarch 2>/dev/null || echo x86_64-linux-gnu)
libdir=/usr/lib/$multiarch
build=${COALESCE_BUILD_DIR:-$root/build}

need() {  # need PATH WHAT: fails with the package to install when PATH is missing
  [[ -e $1 ]] || { echo "prepare.sh: $1 is missing ($2)" >&2; exit 1; }
}
need "$models/stories260K" "set COALESCE_MODELS_DIR to the folder holding stories260K/"
need "$gtest_src/CMakeLists.txt" "apt-get install googletest"
need /usr/include/absl "apt-get install libabsl-dev"
need "$libdir/cmake/absl/abslConfig.cmake" "apt-get install libabsl-dev"
need /usr/include/nlohmann/json.hpp "apt-get install nlohmann-json3-dev"
need /usr/share/cmake/nlohmann_json/nlohmann_jsonConfig.cmake "apt-get install nlohmann-json3-dev"
need "$build/CMakeCache.txt" "run tools/build.sh, or set COALESCE_BUILD_DIR to a configured build"

# Built in a temporary folder and swapped in whole: never half old, half new.
tmp=$(mktemp -d "$root/.gpucheck.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

mkdir -p "$tmp/models"
cp -rL "$models/stories260K" "$tmp/models/"

cp -rL "$gtest_src" "$tmp/googletest"

# Abseil: <prefix>/include/absl, <prefix>/lib/<multiarch>/{libabsl_*.so*,
# cmake/absl}, Debian's layout under another prefix. The package's files
# compute their prefix from their own location (four folders up from
# cmake/absl); /usr appears in them only to recognise a load through the
# /lib -> /usr/lib link, which a copy is not.
mkdir -p "$tmp/absl/include" "$tmp/absl/lib/$multiarch/cmake"
cp -rL /usr/include/absl "$tmp/absl/include/"
cp -P "$libdir"/libabsl_*.so* "$tmp/absl/lib/$multiarch/"  # symlinks stay relative
cp -rL "$libdir/cmake/absl" "$tmp/absl/lib/$multiarch/cmake/"
# Check that claim: no path into /usr outside those guarded lines.
if grep -n '/usr' "$tmp/absl/lib/$multiarch/cmake/absl/"*.cmake | grep -v ':[0-9]*:#' |
  grep -v '_realOrig\|set(_IMPORT_PREFIX "/usr\|set(PACKAGE_PREFIX_DIR "/usr'; then
  echo "prepare.sh: Abseil's CMake files name /usr beyond the relocation guard (above)" >&2
  exit 1
fi
for lib in "$tmp/absl/lib/$multiarch"/libabsl_*.so; do
  [[ -e $lib ]] || { echo "prepare.sh: broken link $lib" >&2; exit 1; }
done

# nlohmann-json: <prefix>/include/nlohmann, <prefix>/share/cmake/nlohmann_json
# (its targets file also computes the prefix from its location).
mkdir -p "$tmp/nlohmann_json/include" "$tmp/nlohmann_json/share/cmake"
cp -rL /usr/include/nlohmann "$tmp/nlohmann_json/include/"
cp -rL /usr/share/cmake/nlohmann_json "$tmp/nlohmann_json/share/cmake/"

# The server and its clients, built here, with their libraries.
server_bins=(coalesce-server coalesce-cli coalesce-bench coalesce-loop-bench)
cmake --build "$build" -j"$(nproc)" --target "${server_bins[@]}" >/dev/null
if ! ldd "$build/bin/coalesce-server" | grep -q 'libcudart\.so'; then
  echo "prepare.sh: $build was built without CUDA (nvcc not found?)" >&2
  exit 1
fi
mkdir -p "$tmp/server/bin" "$tmp/server/libexec" "$tmp/server/lib"
# glibc's own libraries come from the GPU machine (a newer glibc runs programs
# built against an older one); so does the CUDA driver.
system_lib='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libresolv|libutil|libcuda)\.so'
for b in "${server_bins[@]}"; do
  cp "$build/bin/$b" "$tmp/server/libexec/"
  ldd "$build/bin/$b" | awk '$2 == "=>" && $3 ~ /^\// { print $1, $3 }' |
    while read -r name path; do
      [[ $name =~ $system_lib ]] || cp -L "$path" "$tmp/server/lib/$name"
    done
  cat >"$tmp/server/bin/$b" <<EOF
#!/usr/bin/env bash
# $b, built by tools/gpu/prepare.sh, with the libraries beside it and the
# CUDA toolkit's (cuBLAS, loaded at run time) from nvcc's folder.
here=\$(cd "\$(dirname "\$0")/.." && pwd)
nvcc=\$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)
cuda=\$(dirname "\$(dirname "\$(readlink -f "\$nvcc")")")
export LD_LIBRARY_PATH="\$here/lib:\$cuda/lib64:\$cuda/lib\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
exec "\$here/libexec/$b" "\$@"
EOF
  chmod 755 "$tmp/server/bin/$b"
done
# Check that claim: with lib/ first, every library but glibc's resolves there.
for b in "${server_bins[@]}"; do
  if LD_LIBRARY_PATH="$tmp/server/lib" ldd "$tmp/server/libexec/$b" |
    awk '$2 == "=>" { print $1, $3 }' | grep -Ev "$system_lib" | grep -v " $tmp/server/lib/"; then
    echo "prepare.sh: $b loads the libraries above from outside .gpucheck/server/lib" >&2
    exit 1
  fi
done
python3 tests/service/e2e_protos.py "$tmp/e2e.desc"

{
  commit=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
  if [[ -n $(git status --porcelain --untracked-files=no 2>/dev/null) ]]; then
    commit+=" + uncommitted changes"
  fi
  echo "$commit"
} >"$tmp/COMMIT"

rm -rf "$dest"
chmod 755 "$tmp"
mv "$tmp" "$dest"
trap - EXIT
echo "prepare.sh: $(du -sh "$dest" | cut -f1) in $dest ($(cat "$dest/COMMIT"))"
echo "the server there: .gpucheck/server/bin/coalesce-server --device=cuda ..."
echo "configure on the GPU machine with:"
echo "  -DCOALESCE_ENGINE_ONLY=ON -DCOALESCE_HF_FORMATS=OFF \\"
echo "  -DCMAKE_PREFIX_PATH=\"\$PWD/.gpucheck/absl;\$PWD/.gpucheck/nlohmann_json\" \\"
echo "  -DCOALESCE_GTEST_SOURCE=\$PWD/.gpucheck/googletest -DCOALESCE_MODELS_DIR=\$PWD/.gpucheck/models"
