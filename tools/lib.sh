# Shared by the tools/ scripts: where things are, and how to get a pristine DeepSpeed 0.19.8 tree.
# shellcheck shell=bash
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
DEV_TREE=$ROOT/build/deepspeed
CACHE=$ROOT/build/cache
DS_VERSION=0.19.8
SDIST_NAME=deepspeed-$DS_VERSION.tar.gz
PRISTINE_TAG=v$DS_VERSION-pristine
# Files of the sdist that its setup.py rewrites on every install: kept out of git so that an install
# leaves the dev tree clean.
GENERATED_EXCLUDES=('/deepspeed.egg-info/' '/deepspeed/git_version_info_installed.py' '/build/' '/dist/'
    '__pycache__/' '*.so')

say() { printf '==> %s\n' "$*" >&2; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

sdist_sha256() { sed -n 's/.*--hash=sha256:\([0-9a-f]*\).*/\1/p' "$ROOT/requirements/upstream.txt"; }

# Print the path of the verified sdist, fetching it with pip when it is not already here.
fetch_sdist() {
    local want have path
    want=$(sdist_sha256)
    path=${DS_SDIST:-$CACHE/$SDIST_NAME}
    if [ ! -f "$path" ]; then
        mkdir -p "$CACHE"
        say "fetching $SDIST_NAME with pip (hash-checked)"
        "${PIP_PYTHON:-python3}" -m pip download -q --no-deps --no-binary :all: --require-hashes \
            -r "$ROOT/requirements/upstream.txt" -d "$CACHE" >&2
        path=$CACHE/$SDIST_NAME
    fi
    have=$(sha256sum "$path" | cut -d' ' -f1)
    [ "$have" = "$want" ] || die "$path: sha256 $have, expected $want (requirements/upstream.txt)"
    printf '%s\n' "$path"
}

# The ordered list of patch files, from patches/series.
series_files() {
    [ -f "$ROOT/patches/series" ] || return 0
    grep -v '^\s*\(#\|$\)' "$ROOT/patches/series" | sed "s|^|$ROOT/patches/|"
}

git_quiet() { git -c advice.detachedHead=false "$@"; }

# Unpack the pristine sdist into $1 as a git repo whose first commit is tagged $PRISTINE_TAG.
# The commit is made with fixed identity and dates, so its tree and hash are the same everywhere.
unpack_pristine() {
    local dest=$1 sdist
    sdist=$(fetch_sdist)
    rm -rf "$dest"
    mkdir -p "$dest"
    tar --no-same-owner -xzf "$sdist" -C "$dest" --strip-components=1
    git -C "$dest" init -q -b main
    printf '%s\n' "${GENERATED_EXCLUDES[@]}" >>"$dest/.git/info/exclude"
    git -C "$dest" add -A
    GIT_AUTHOR_NAME="DeepSpeed $DS_VERSION sdist" GIT_AUTHOR_EMAIL="sdist@localhost" \
        GIT_COMMITTER_NAME="DeepSpeed $DS_VERSION sdist" GIT_COMMITTER_EMAIL="sdist@localhost" \
        GIT_AUTHOR_DATE="2000-01-01T00:00:00Z" GIT_COMMITTER_DATE="2000-01-01T00:00:00Z" \
        git -C "$dest" commit -q -m "DeepSpeed $DS_VERSION, pristine sdist ($SDIST_NAME)"
    git -C "$dest" tag "$PRISTINE_TAG"
}

# Apply patches/series to the git repo $1 as commits.
apply_series() {
    local dest=$1 files
    mapfile -t files < <(series_files)
    [ ${#files[@]} -eq 0 ] && return 0
    git -C "$dest" am -q --committer-date-is-author-date "${files[@]}" >&2 \
        || die "patches/ does not apply to pristine DeepSpeed $DS_VERSION (see git am output above)"
}

# Write the commits $PRISTINE_TAG..HEAD of the repo $1 as patch files into the folder $2, with a series file.
format_series() {
    local src=$1 out=$2
    mkdir -p "$out"
    git -C "$src" format-patch -q --zero-commit --no-signature --no-numbered --full-index \
        -o "$out" "$PRISTINE_TAG..HEAD" >/dev/null
    # Two pull requests: the zero_to_fp32 change (its leading patches), independent of the feature after it.
    {
        echo "# Apply in this order onto a pristine DeepSpeed $DS_VERSION tree (git am)."
        echo "# Pull request 1, on its own: zero_to_fp32 returns frozen parameters as fp32."
        (cd "$out" && ls -1 -- *.patch 2>/dev/null || true) | awk '
            !/^[0-9]+-zero_to_fp32-/ && !feature { print "# Pull request 2: keep the parameters a model names" \
                " for fp32 in fp32, in every ZeRO stage."; feature = 1 }
            { print }'
    } >"$out/series"
}
