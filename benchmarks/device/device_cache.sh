#!/usr/bin/env bash
# A fresh device machine spends minutes compiling what the last one already compiled: the Numba host
# kernels (host/__pycache__) and JAX's compiled steps (JAX_COMPILATION_CACHE_DIR). These two
# functions carry them from one device call to the next through the working tree:
#   save OUT_DIR     (at the end of a call) host/*.py's modification times, the Numba cache and the
#                    JAX cache as OUT_DIR/device-cache.txz.partNN (15 MiB parts: the device tool
#                    returns files of at most 16 MiB)
#   restore DIR      (at the start of the next call; DIR: the parts, carried, e.g. .device_cache)
#                    unpacks them and sets host/*.py's modification times back: Numba's cache index
#                    is keyed by each source file's path, size and mtime, and a copied tree has new
#                    mtimes (the compiled code is also keyed by the CPU model: another CPU recompiles)
# Usage: source benchmarks/device/device_cache.sh; device_cache_restore .device_cache; ...; device_cache_save "$OUT"
jax_cache_dir=${JAX_COMPILATION_CACHE_DIR:-/tmp/jhybrid-jax-cache}

device_cache_save() {
  local out=$1 tmp
  tmp=$(mktemp -d)
  # nanoseconds (Numba compares the float st_mtime) and each file's SHA-256: restore sets a file's
  # time back only where its text is unchanged, so an edited module recompiles instead of loading
  # the kernels of its old text (Numba's index checks the time and size, not the text)
  python3 -c 'import glob, hashlib, os
for p in sorted(glob.glob("host/*.py")):
    print(os.stat(p).st_mtime_ns, hashlib.sha256(open(p, "rb").read()).hexdigest(), p)' > "$tmp/mtimes.txt"
  mkdir -p "$tmp/numba" "$tmp/jax"
  cp host/__pycache__/*.nbi host/__pycache__/*.nbc "$tmp/numba/" 2>/dev/null
  if [ -d "$jax_cache_dir" ]; then
    # only what this call read or wrote: restore set every restored file's access time to 2000, and a
    # read moves it (relatime), so stale programs of older code do not grow the carry (64 MiB at most);
    # where nothing moved (a noatime mount) everything goes
    local used
    used=$(find "$jax_cache_dir" -type f -newerat "2001-01-01" | wc -l)
    if [ "$used" -gt 0 ]; then
      (cd "$jax_cache_dir" && find . -type f -newerat "2001-01-01" -print0 | tar cf - --null -T - | tar xf - -C "$tmp/jax")
      echo "device cache: $used of $(find "$jax_cache_dir" -type f | wc -l) JAX cache files used in this call"
    else
      cp -r "$jax_cache_dir/." "$tmp/jax/"
    fi
  fi
  # xz: the Numba cache shrinks to less than half of gzip's, and the carry is 64 MiB with the tree
  tar cf - -C "$tmp" mtimes.txt numba jax | xz -9 -T0 | split -b 15M -d - "$out/device-cache.txz.part"
  echo "device cache saved: $(ls "$tmp/numba" | wc -l) Numba files, $(du -sh "$tmp/jax" | cut -f1) of JAX cache," \
       "$(cat "$out"/device-cache.txz.part* | wc -c) bytes compressed"
  rm -rf "$tmp"
}

device_cache_restore() {
  local dir=$1 tmp
  if ! ls "$dir"/device-cache.txz.part* >/dev/null 2>&1; then
    echo "device cache: none in $dir (a fresh compile)"
    return 1
  fi
  tmp=$(mktemp -d)
  cat "$dir"/device-cache.txz.part* | xz -d | tar xf - -C "$tmp" || { echo "device cache: unreadable"; return 1; }
  mkdir -p host/__pycache__ "$jax_cache_dir"
  cp "$tmp"/numba/* host/__pycache__/ 2>/dev/null
  cp -r "$tmp/jax/." "$jax_cache_dir/"
  find "$jax_cache_dir" -type f -exec touch -a -d "2000-01-01" {} +  # device_cache_save keeps what is read after
  python3 -c 'import hashlib, os, sys
stale = []
for line in open(sys.argv[1]):
    fields = line.split()
    if len(fields) != 3:  # a cache saved before the hashes: nothing can be checked, so none is used
        stale.append(fields[-1])
        continue
    ns, digest, path = fields
    if not os.path.isfile(path) or hashlib.sha256(open(path, "rb").read()).hexdigest() != digest:
        stale.append(path)
        continue
    os.utime(path, ns=(int(ns), int(ns)))
if stale:
    print(f"device cache: {len(stale)} host module(s) changed since it was saved, recompiled: {stale}")' "$tmp/mtimes.txt"
  echo "device cache restored: $(ls "$tmp/numba" | wc -l) Numba files, $(du -sh "$tmp/jax" | cut -f1) of JAX cache"
  rm -rf "$tmp"
}
