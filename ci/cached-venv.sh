# Sourced by the jobs that need a pinned stack of their own (ci/tpu.sh, ci/vllm.sh): such a
# stack pins its own torch (several GB), so it lives in a virtual environment cached outside
# the clone and keyed by the versions, ${KVHOST_CACHE:-$HOME/.cache/kvhost}/venv-<key>-py<P>.
# The environment is marked complete only after every install succeeded, so an interrupted
# install is redone, never used half-made.
#
#   cached_venv JOB KEY ABOUT PACKAGES... [-- PACKAGES...]
#
# builds it once (one pip install per group of packages, groups split by --) or reuses it,
# then points it at this clone's kvhost (no deps: the pinned torch must stay). It sets
# $venv, holds a lock on the environment for the rest of the job (two clones on one runner
# share it) and defines `quiet`, which shows pip's chatter only when a command fails.

cached_venv() {
    local job=$1 key=$2 about=$3 started=$SECONDS
    shift 3
    local python=${PYTHON:-python3} py_version cache_root
    py_version=$("$python" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')
    cache_root=${KVHOST_CACHE:-$HOME/.cache/kvhost}
    venv="$cache_root/venv-$key-py$py_version"
    mkdir -p "$cache_root"
    _cached_venv_log="$cache_root/venv-$job-install.log"
    _cached_venv_job=$job
    exec 9>"$cache_root/venv-$job.lock"
    flock 9
    if [[ -f "$venv/.kvhost-ready" ]]; then
        echo "$job: reusing $venv"
    else
        echo "$job: building $venv ($about, once)"
        rm -rf "$venv"
        "$python" -m venv "$venv"
        quiet "$venv/bin/python" -m pip install --upgrade pip
        local group=()
        for package in "$@" --; do
            if [[ $package != -- ]]; then
                group+=("$package")
            elif ((${#group[@]} > 0)); then
                quiet "$venv/bin/python" -m pip install "${group[@]}"
                group=()
            fi
        done
        touch "$venv/.kvhost-ready"
        echo "$job: built in $((SECONDS - started)) s, $(du -sh "$venv" | cut -f1)"
    fi
    quiet "$venv/bin/python" -m pip install --no-deps -e .
}

quiet() {
    "$@" >"$_cached_venv_log" 2>&1 || {
        cat "$_cached_venv_log"
        echo "$_cached_venv_job: failed: $*" >&2
        return 1
    }
}
