#!/bin/bash
# Wheels of fedray at two commits, for ab.sh on a GPU machine: .devenv/a/ and .devenv/b/. Run here
# after `make install` and bundle.sh (whose site folder ab.sh needs too):
#     bash benchmarks/offline_gpu/wheels.sh <commit A> <commit B>     (default B: the working tree)
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 1 ] || { echo "usage: $0 <commit A> [<commit B>]" >&2; exit 2; }
build() {  # build <name> <source folder>
    rm -rf ".devenv/$1" && mkdir -p ".devenv/$1"
    (cd "$2" && "$OLDPWD/.venv/bin/pip" wheel -q --no-deps --no-build-isolation -w "$OLDPWD/.devenv/$1" . >/dev/null && rm -rf build)
}
work=$(mktemp -d)
trap 'git worktree remove --force "$work/a" 2>/dev/null; git worktree remove --force "$work/b" 2>/dev/null; rm -rf "$work"' EXIT
git worktree add -q --detach "$work/a" "$1"
build a "$work/a"
if [ $# -ge 2 ]; then
    git worktree add -q --detach "$work/b" "$2"
    build b "$work/b"
else
    build b .
fi
ls -la .devenv/a .devenv/b
