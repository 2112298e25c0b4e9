#!/usr/bin/env bash
# Adds the kernels a GPU run compiled (bench/gpu_pending.sh's OUT/kernels_new.tar.xz, one or more) to the kernel
# cache that GPU runs carry (.devcache/tc.a?, 9 MiB xz parts of the Triton and Inductor caches), so that the next
# runs find them instead of compiling for minutes. Refuses a result that would not fit the 64 MiB a run carries
# beside .whl/, keeping the old parts.
#
#   bash bench/kernel_cache_merge.sh r2/kernels_new.tar.xz [MORE.tar.xz ...]   # from the repository root
set -euo pipefail
[ $# -ge 1 ] || { echo "give one or more kernels_new.tar.xz files" >&2; exit 2; }
top=$(git rev-parse --show-toplevel)
cache="$top/.devcache"
limit_mib=${K3_CARRY_LIMIT_MIB:-64}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir "$work/tree" "$work/parts"
if ls "$cache"/tc.a? >/dev/null 2>&1; then
  cat "$cache"/tc.a? | xz -d | tar -xf - -C "$work/tree"
fi
before=$(find "$work/tree" -type f | wc -l)
for delta in "$@"; do
  xz -d < "$delta" | tar -xf - -C "$work/tree"
done
after=$(find "$work/tree" -type f | wc -l)
(cd "$work/tree" && tar -cf - . | xz -T0 -6 | split -b 9m - "$work/parts/tc.")
new_bytes=$(cat "$work/parts"/tc.* | wc -c)
whl_bytes=$(du -cb "$top"/.whl 2>/dev/null | tail -1 | cut -f1)
total_mib=$(( (new_bytes + whl_bytes) / 1048576 ))
echo "cache files: $before -> $after; packed $(( new_bytes / 1048576 )) MiB, with .whl/ $total_mib MiB (limit $limit_mib)"
if [ "$total_mib" -ge "$limit_mib" ]; then
  echo "not replaced: .devcache/ and .whl/ would not fit what a run carries; the old parts stay" >&2
  exit 1
fi
mkdir -p "$cache"
chmod u+w "$cache"/tc.a? 2>/dev/null || true
rm -f "$cache"/tc.a?
cp "$work/parts"/tc.* "$cache/"
echo "replaced $cache/tc.a? ($(ls "$cache"/tc.a? | wc -l) parts)"
