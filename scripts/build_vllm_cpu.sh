#!/usr/bin/env bash
# Builds vLLM's CPU backend from the release's source distribution, once, into a cache outside the
# repository, and installs it into a venv for the vLLM test tier. vLLM publishes prebuilt CPU wheels
# only up to 0.32; later releases build here from source (docs/VLLM_BUILD.md: time, size, patches).
#
#   scripts/build_vllm_cpu.sh VERSION VENV
#
# The wheel lands in $KVSTRIDE_CACHE/vllm-VERSION-cpu/ (default ~/.cache/kvstride); a second run
# finds it and only installs. Needs: python3.11, a C++17 compiler, cargo (vLLM's Rust frontend),
# and PyPI, crates.io and Debian's archive on the network.
set -euo pipefail

version=${1:?usage: build_vllm_cpu.sh VERSION VENV}
venv=${2:?usage: build_vllm_cpu.sh VERSION VENV}
python=${PYTHON:-python3}
cache=${KVSTRIDE_CACHE:-$HOME/.cache/kvstride}/vllm-$version-cpu
jobs=${MAX_JOBS:-$(nproc)}

# What each release needs, pinned: its sdist's sha256, the torch it is built against, and the
# oneDNN source its CMake fetches from GitHub: Debian's source package instead (its release's
# pool, checked by the md5 Debian's Sources index gives), for hosts that reach no GitHub.
case "$version" in
  0.34.0)
    sdist_sha256=fcad848b246a9d8652b47e6425af92334dc02492f9802720f54e27b823cf0113
    torch_pin=torch==2.14.0
    onednn_tarball=onednn_3.7.2+ds.orig.tar.xz  # Debian 13; vLLM pins v3.13
    onednn_md5=82a5dbb097b6282c1b5ba5f1a87d9cb2
    ;;
  *) echo "build_vllm_cpu.sh: no build recipe for vLLM $version (known: 0.34.0)" >&2; exit 2 ;;
esac

mkdir -p "$cache"
log() { echo "build_vllm_cpu: $*" >&2; }

# vLLM's CPU kernels include libnuma's header (Debian: libnuma-dev) and link it.
if [ ! -f /usr/include/numa.h ]; then
  if [ "$(id -u)" = 0 ]; then
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libnuma-dev >/dev/null
  else
    log "vLLM's CPU build needs libnuma's header: sudo apt-get install libnuma-dev"; exit 1
  fi
fi

fetch() {  # URL FILE CHECK-COMMAND DIGEST
  local url=$1 file=$2 check=$3 digest=$4
  if [ ! -f "$file" ]; then
    log "downloading $url"
    curl -fsSL --retry 3 -o "$file.part" "$url"
    mv "$file.part" "$file"
  fi
  echo "$digest  $file" | $check -c --quiet - || { rm -f "$file"; log "$file: digest mismatch"; exit 1; }
}

wheel=$(ls "$cache"/vllm-"$version"*.whl 2>/dev/null | head -1 || true)
if [ -z "$wheel" ]; then
  started=$(date +%s)
  sdist="$cache/vllm-$version.tar.gz"
  sdist_url=$(curl -fsSL https://pypi.org/simple/vllm/ \
    | grep -o "https://[^\"#]*/vllm-$version.tar.gz" | head -1)
  fetch "$sdist_url" "$sdist" sha256sum "$sdist_sha256"
  fetch "http://deb.debian.org/debian/pool/main/o/onednn/$onednn_tarball" \
    "$cache/$onednn_tarball" md5sum "$onednn_md5"

  # The sources and their build tree stay until a wheel is built: a failed build resumes.
  src="$cache/src"
  if [ ! -f "$src/.extracted" ]; then
    rm -rf "$src" && mkdir -p "$src"
    tar -xzf "$sdist" -C "$src" --strip-components=1
    # Debian 12's g++ is 12.2; vLLM's CMake asks for 12.3 (docs/VLLM_BUILD.md: what 12.2 compiles).
    sed -i 's/CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.3/CMAKE_CXX_COMPILER_VERSION VERSION_GREATER_EQUAL 12.2/' \
      "$src/cmake/cpu_extension.cmake"
    # g++ 12.2's one crash on vLLM's kernels (an internal compiler error on a lambda's array bound
    # naming a local constexpr of its template function): the constant made static.
    sed -i 's/^  constexpr int64_t kBLOCK_H_MAX = 16;$/  static constexpr int64_t kBLOCK_H_MAX = 16;/' \
      "$src/csrc/cpu/sgl-kernels/flash_mla.cpp"
    mkdir -p "$src/onednn"
    tar -xJf "$cache/$onednn_tarball" -C "$src/onednn" --strip-components=1
    touch "$src/.extracted"
  fi

  build_venv="$cache/build-venv"
  [ -x "$build_venv/bin/python" ] || "$python" -m venv "$build_venv"
  "$build_venv/bin/python" -m pip install -q -U pip
  # vLLM's own build requirements, with PyPI's torch of the pinned version (its +cpu build lives on
  # PyTorch's index only); a CUDA torch builds and runs the CPU backend.
  "$build_venv/bin/python" -m pip install -q "cmake>=3.26.1" ninja "packaging>=24.2" \
    "setuptools==78.1.1" "setuptools-scm>=8" "setuptools-rust>=1.9.0" wheel "jinja2>=3.1.6" regex \
    "$torch_pin"
  # PyPI's torch is a CUDA build, and its CMake package then demands a CUDA toolkit: the CPU
  # backend links none of CUDA, so its CMake files are told torch has no CUDA (the build venv's
  # copy only; the torch that runs is untouched).
  "$build_venv/bin/python" - <<'PATCH'
import pathlib, torch
share = pathlib.Path(torch.__file__).parent / "share/cmake"
for name, guard in (("Caffe2/Caffe2Config.cmake", "if(1)\n  # The file public/cuda.cmake"),
                    ("Torch/TorchConfig.cmake", "if(1)\n  if(MSVC)")):
    path = share / name
    text = path.read_text()
    if guard in text:
        path.write_text(text.replace(guard, guard.replace("if(1)", "if(0)", 1), 1))
# Its exported targets still name CUDA's runtime: an empty one (nothing of CUDA is linked).
path = share / "Caffe2/Caffe2Config.cmake"
text = path.read_text()
if "add_library(torch::cudart" not in text:
    path.write_text("if(NOT TARGET torch::cudart)\n  add_library(torch::cudart INTERFACE IMPORTED)\nendif()\n" + text)
PATCH
  log "compiling (MAX_JOBS=$jobs)"
  (cd "$src" && env VLLM_TARGET_DEVICE=cpu FETCHCONTENT_SOURCE_DIR_ONEDNN="$src/onednn" \
      MAX_JOBS="$jobs" PATH="$build_venv/bin:$PATH" \
      "$build_venv/bin/python" -m pip wheel -v --no-build-isolation --no-deps -w "$cache" .) \
    > "$cache/build.log" 2>&1 || { tail -40 "$cache/build.log" >&2; log "failed: $cache/build.log"; exit 1; }
  wheel=$(ls "$cache"/vllm-"$version"*.whl | head -1)
  log "built $(basename "$wheel") ($(du -h "$wheel" | cut -f1)) in $(( ($(date +%s) - started) / 60 )) min"
  # What a second run needs is the wheel: the sources and the build venv go.
  rm -rf "$src" "$build_venv"
fi

# The runtime requirements the wheel names, but torch from PyPI at the pinned version, and without
# what only media models or Triton on CPU need (Triton's CPU build is on GitHub only; the CUDA
# builds of torchvision/torchaudio/torchcodec break `import vllm` next to it).
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
"$venv/bin/python" -m pip install -q -U pip "maturin>=1.5,<2"
requirements="$cache/requirements.txt"
unzip -p "$wheel" "vllm-*.dist-info/METADATA" \
  | sed -n 's/^Requires-Dist: //p' | grep -v 'extra ==' \
  | grep -v -E '^(torch|torchvision|torchaudio|torchcodec|triton)\b' > "$requirements"
echo "$torch_pin" >> "$requirements"
"$venv/bin/python" -m pip install -q -r "$requirements"
"$venv/bin/python" -m pip install -q --no-deps "$wheel"
log "vLLM $version installed in $venv"
