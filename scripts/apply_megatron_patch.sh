#!/usr/bin/env bash
# Apply megatron-zeppelin's patch to a Megatron-LM checkout.
#
#   scripts/apply_megatron_patch.sh MEGATRON_LM_DIR            # apply (idempotent)
#   scripts/apply_megatron_patch.sh --revert MEGATRON_LM_DIR   # take it out again
#
# The Megatron-LM version is read from `git describe` (an exact core_v* tag) or,
# for a tarball or a branch, from megatron/core/package_info.py.  Only the pinned
# tags below are supported; anything else is refused rather than half-applied.
set -euo pipefail

usage() { echo "usage: $0 [--revert] MEGATRON_LM_DIR" >&2; exit 2; }
die() { echo "apply_megatron_patch: error: $*" >&2; exit 2; }

revert=0
if [[ "${1:-}" == "--revert" ]]; then revert=1; shift; fi
[[ $# -eq 1 ]] || usage
mlm_dir=$1
patch_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/patches"

[[ -f "$mlm_dir/pretrain_gpt.py" && -f "$mlm_dir/megatron/core/package_info.py" ]] ||
  die "$mlm_dir is not a Megatron-LM checkout (no pretrain_gpt.py or megatron/core/package_info.py); clone https://github.com/NVIDIA/Megatron-LM and check out core_v0.16.1 or core_v0.19.0"

# 1) An exact release tag names the patch directly.
tag=$(git -C "$mlm_dir" describe --tags --exact-match 2>/dev/null || true)
# 2) Otherwise map the package version to the tag it ships in.
if [[ -z "$tag" || ! -d "$patch_root/$tag" ]]; then
  version=$(cd "$mlm_dir" && python3 - 2>/dev/null <<'PY'
import re
text = open("megatron/core/package_info.py").read()
get = lambda k: re.search(rf"^{k}\s*=\s*['\"]?([^'\"\n]*)", text, re.M).group(1)
print(f"{get('MAJOR')}.{get('MINOR')}.{get('PATCH')}{get('PRE_RELEASE')}")
PY
  ) || die "cannot read the version from $mlm_dir/megatron/core/package_info.py (no MAJOR/MINOR/PATCH/PRE_RELEASE lines); check out a release tag"
  case "$version" in
    0.16.1) tag=core_v0.16.1 ;;
    # The core_v0.19.0 tag's package_info.py already says 0.19.1 (its release
    # commit bumps the version), so both numbers mean that tree.
    0.19.0 | 0.19.1) tag=core_v0.19.0 ;;
    *) die "unknown Megatron-LM version $version${tag:+ (tag $tag)}; supported: core_v0.16.1, core_v0.19.0 — check out one of these tags (git -C $mlm_dir checkout core_v0.19.0)" ;;
  esac
fi

shopt -s nullglob
patches=("$patch_root/$tag"/*.patch)
[[ ${#patches[@]} -gt 0 ]] || die "no patch for $tag under $patch_root"

for p in "${patches[@]}"; do
  name=$(basename "$p")
  if [[ $revert -eq 1 ]]; then
    if git -C "$mlm_dir" apply --check "$p" 2>/dev/null; then
      echo "$tag/$name: not applied in $mlm_dir; nothing to revert"
    elif git -C "$mlm_dir" apply --reverse --check "$p" 2>/dev/null; then
      git -C "$mlm_dir" apply --reverse "$p"
      echo "$tag/$name: reverted in $mlm_dir"
    else
      die "$tag/$name neither applies nor reverts cleanly in $mlm_dir (local edits to pretrain_gpt.py?)"
    fi
  elif git -C "$mlm_dir" apply --reverse --check "$p" 2>/dev/null; then
    echo "$tag/$name: already applied in $mlm_dir"
  elif git -C "$mlm_dir" apply --check "$p" 2>/dev/null; then
    git -C "$mlm_dir" apply "$p"
    echo "$tag/$name: applied to $mlm_dir"
  else
    git -C "$mlm_dir" apply --check "$p" || true
    die "$tag/$name does not apply to $mlm_dir (see above); start from a clean $tag checkout"
  fi
done
