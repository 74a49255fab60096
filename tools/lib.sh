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

# The pull requests of the series, in order, one line each: the file name (without its number) its first patch
# starts with | the pull requests it applies on ("-": stock 0.19.8 alone) | what it does.
PULL_REQUESTS=(
    'zero_to_fp32-return-frozen-parameters|-|zero_to_fp32 returns frozen parameters as fp32'
    'zero-stage_1_and_2-link-fp32-masters|-|stock fixes the series builds on: ZeRO-1/2 and the BF16 optimizer link fp32 masters and loaded optimizer states to the right parameters, a universal checkpoint loads on a rank that holds only padding of a group, and zero_to_fp32 reads BF16 optimizer checkpoints'
    'zero-stage3-give-each-sub-group-its-own-step|-|keep the parameters a model names for fp32 in fp32 under ZeRO-3'
    'runtime-match-keep_in_fp32_modules-against-names-wit|3|match keep_in_fp32_modules against names without PEFT'"'"'s wrappers'
    'zero-stage3-offload-the-partitions|3|keep them in fp32 with ZeRO-3 CPU parameter offload'
    'zero-stage_1_and_2-move-a-group|2 3 5 12|keep them in fp32 under ZeRO-1/2'
    'bf16_optimizer-hold-parameters-kept-in-fp32|2 3 5 12 6|keep them in fp32 with the BF16 optimizer'
    'fp16-fused_optimizer-hold-parameters|2 3 5 12 6 7|keep them in fp32 without ZeRO'
    'zero-all-gather-hpZ-s-secondary|3|fetch hpZ'"'"'s secondary partitions of both dtypes in one all-gather'
    'zero-keep-the-partitions-of-parameters-kept-in-fp32-|2 3 5 12 6 7 8|keep them in fp32 with ZeRO-3 parameter offload to NVMe'
    'runtime-update-the-parameters-a-model-names-for-fp32|2 3 5 12 6 7 8 10|keep them in fp32 with the Muon optimizer'
    'ops-adam-count-each-parameter-s-steps-in-FusedAdam|-|FusedAdam counts each parameter'"'"'s steps'
)

# Write the commits $PRISTINE_TAG..HEAD of the repo $1 as patch files into the folder $2, with a series file that
# marks where each pull request starts ("# Pull request N, on ...: what").
format_series() {
    local src=$1 out=$2 entry first on title n=0
    mkdir -p "$out"
    git -C "$src" format-patch -q --zero-commit --no-signature --no-numbered --full-index \
        -o "$out" "$PRISTINE_TAG..HEAD" >/dev/null
    {
        echo "# Apply in this order onto a pristine DeepSpeed $DS_VERSION tree (git am)."
        for patch in $(cd "$out" && ls -1 -- *.patch 2>/dev/null); do
            for entry in "${PULL_REQUESTS[@]}"; do
                IFS='|' read -r first on title <<<"$entry"
                if [[ $patch == [0-9][0-9][0-9][0-9]-$first* ]]; then
                    n=$((n + 1))
                    if [ "$on" = - ]; then
                        echo "# Pull request $n, on stock $DS_VERSION alone: $title."
                    else
                        local word=request
                        [[ $on == *" "* ]] && word=requests
                        echo "# Pull request $n, on pull $word ${on// /, }: $title."
                    fi
                fi
            done
            echo "$patch"
        done
    } >"$out/series"
}

# The patch files of pull request $1 (a number), from patches/series.
pull_request_files() {
    awk -v n="$1" '/^# Pull request / { split($4, a, ","); pr = a[1] } !/^#/ && NF && pr == n' \
        "$ROOT/patches/series" | sed "s|^|$ROOT/patches/|"
}

# The pull requests pull request $1 applies on (numbers), from patches/series; nothing for stock 0.19.8 alone.
pull_request_bases() {
    sed -n "s/^# Pull request $1, on pull requests\{0,1\} \([0-9, ]*\):.*/\1/p" "$ROOT/patches/series" | tr -d ','
}

# Make $2 the tree of pull request $1 (pristine 0.19.8 with the pull requests it applies on, then its own patches),
# unless it is that tree already (the stamp holds the sha256 of the patch files it was made from).
pull_request_tree() {
    local pr=$1 dest=$2 files=() base stamp
    for base in $(pull_request_bases "$pr") "$pr"; do
        mapfile -t -O "${#files[@]}" files < <(pull_request_files "$base")
    done
    [ ${#files[@]} -gt 0 ] || die "patches/series has no pull request $pr"
    stamp=$(cat "${files[@]}" | sha256sum | cut -d' ' -f1)
    [ -f "$dest/.pull-request-stamp" ] && [ "$(cat "$dest/.pull-request-stamp")" = "$stamp" ] && return 0
    say "making the tree of pull request $pr (on: $(pull_request_bases "$pr" | xargs)) in $dest"
    unpack_pristine "$dest"
    git -C "$dest" -c user.name=test -c user.email=test@localhost am -q "${files[@]}" >&2 \
        || die "pull request $pr does not apply on the pull requests it names"
    printf '%s\n' "$stamp" >"$dest/.pull-request-stamp"
}
