# What every device batch script shares, sourced after it sets OUT and LOG (the log's file name):
# everything printed also goes to $OUT/$LOG; the wheels in .whl/ (and in any carried .whl-*/ folder)
# installed into /tmp/site (the machine has no PyPI); repo=the checkout, the working directory a fresh temporary one; section and
# bench (a command under a time limit in seconds, so the batch fits its device call).
mkdir -p "$OUT"
exec > >(tee "$OUT/$LOG") 2>&1

python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    $(ls .whl/*.whl .whl-*/*.whl 2>/dev/null) || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 LOONGFORGE_CACHE=/tmp/lf-cache
repo=$PWD
cd "$(mktemp -d)"

section() { printf '\n===== %s =====\n' "$*"; }
bench() {
  local limit=$1; shift
  section "$* (limit ${limit}s)"
  local t0=$SECONDS
  timeout "$limit" "$@"; echo "exit code: $? after $((SECONDS - t0)) s"
}
