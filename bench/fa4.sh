#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4, its CuTe DSL Hopper forward) on a GPU machine without a
# network, for bench_fwd.py's FA4 column. Its wheels are about 100 MB, over one device
# call's 64 MiB carry, so they travel in two calls on the same warm machine (a machine is
# given back ~30 s after a call: start the second at once):
#   here, once:       bash bench/fa4.sh fetch      # _ext/fa4_libs/libs.tar.xz, _ext/fa4_wheels/
#   GPU call 1:       bash bench/fa4.sh unpack-libs      (carry ["_ext/fa4_libs"])
#   GPU call 2:       bash bench/fa4.sh unpack-wheels && . bench/fa4.sh env && python3 bench/bench_fwd.py ...
#                                                        (carry ["_ext/fa4_wheels"])
# _ext/ is ignored; nothing of FA4 is committed. The versions are the ones shared/PEERS.md
# measured (PyTorch 2.11 for CUDA 13 and Python 3.12 on the GPU machine).
set -eu
FA4=flash-attn-4==4.0.0b36
DSL=4.8.1
DEST=_ext/fa4

case "${1:-}" in
fetch)
  rm -rf _ext/fa4_download _ext/fa4_libs _ext/fa4_wheels
  mkdir -p _ext/fa4_download _ext/fa4_libs _ext/fa4_wheels
  python3 -m pip download -q --no-deps --python-version 3.12 --only-binary=:all: \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 --platform any \
    -d _ext/fa4_download "$FA4" "nvidia-cutlass-dsl==$DSL" "nvidia-cutlass-dsl-libs-base==$DSL" \
    "nvidia-cutlass-dsl-libs-core==$DSL" "nvidia-cutlass-dsl-libs-cu13==$DSL" apache-tvm-ffi \
    torch-c-dlpack-ext quack-kernels
  # the CUDA 13 libraries' wheel, unzipped and packed with xz (about 64 MB): call 1's carry
  libs=$(ls _ext/fa4_download/nvidia_cutlass_dsl_libs_cu13-*.whl)
  mkdir -p _ext/fa4_download/libs
  python3 -m zipfile -e "$libs" _ext/fa4_download/libs
  tar -C _ext/fa4_download/libs -cf - . | xz -9 -T0 > _ext/fa4_libs/libs.tar.xz
  # the rest, as wheels (about 10 MB): call 2's carry
  for w in _ext/fa4_download/*.whl; do
    [ "$w" = "$libs" ] || cp "$w" _ext/fa4_wheels/
  done
  du -sh _ext/fa4_libs _ext/fa4_wheels ;;
unpack-libs)
  mkdir -p "$DEST"
  xz -dc _ext/fa4_libs/libs.tar.xz | tar -C "$DEST" -xf -
  echo "libraries in $DEST" ;;
unpack-wheels)
  [ -d "$DEST" ] || { echo "no $DEST: run unpack-libs on this machine first" >&2; exit 2; }
  for w in _ext/fa4_wheels/*.whl; do python3 -m zipfile -e "$w" "$DEST"; done
  echo "wheels in $DEST" ;;
env)  # sourced: FA4's packages first on the path
  export PYTHONPATH=$PWD/$DEST:$PWD/$DEST/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "from flash_attn.cute import flash_attn_func" \
    && echo "flash_attn.cute imports" || echo "flash_attn.cute does not import" ;;
*)
  sed -n 2,11p "$0" >&2; exit 2 ;;
esac
