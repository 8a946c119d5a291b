# Sourced by the GPU scripts (with PY set): the wheels carried in .whl/ for packages the device machine lacks.
#
#   install_wheels [TARGET]   pip-installs .whl/*.whl into TARGET (default /tmp/site); returns 1 when there are no
#                             wheels (or NO_WHL / SKIP_WHEELS=1 is set) and exits the script when the install fails
#   tree_id                   the short hash of the tree's src/ files: the device's copy of .git may be stale, so its
#                             `git rev-parse` does not say which code ran (compare with the same line run here)
install_wheels() {
  local target=${1:-/tmp/site}
  if [ -n "${NO_WHL:-}" ] || [ "${SKIP_WHEELS:-0}" = 1 ] || ! compgen -G ".whl/*.whl" >/dev/null; then
    return 1
  fi
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$target" .whl/*.whl \
    || { echo "wheel install failed" >&2; exit 1; }
}

tree_id() {
  find src -name '*.py' -print0 | LC_ALL=C sort -z | xargs -0 cat | sha1sum | cut -c1-12
}
