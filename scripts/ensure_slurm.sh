#!/bin/sh
# Called by `make test` before pytest: make the single-node SLURM cluster of .ci/install_slurm.sh available
# when this machine can run it, so the real-SLURM tests run instead of skipping. Never fails the build: when
# SLURM cannot be started it prints why, loudly, and the SLURM tests skip with the same reason.
#
#   - SLURM already answering (CI: .ci/run started it): nothing to do (one `sinfo`, well under a second).
#   - root, Debian/Ubuntu, SLURM packages installed: start munge + slurmctld + slurmd (.ci/install_slurm.sh,
#     idempotent, a few seconds).
#   - packages missing: installing them needs the network and apt, so only with REGENT_INSTALL_SLURM=1.
#   - REGENT_SLURM=0: leave SLURM alone (its tests skip if it is not running).
set -u
cd "$(dirname "$0")/.."

say() { echo "[make test] $*"; }
skip() {
    echo "" >&2
    echo "[make test] ***** SLURM tests will SKIP: $* *****" >&2
    echo "" >&2
    exit 0
}
usable() {
    sinfo -h -o '%t' 2>/dev/null | grep -Eq '^(idle|mix|alloc)'
}

if [ "${REGENT_SLURM:-1}" = 0 ]; then
    say "REGENT_SLURM=0: not starting SLURM"
    exit 0
fi
if command -v sinfo >/dev/null 2>&1 && usable; then
    say "SLURM is up: $(sinfo -h -o '%P %t %D node(s)' | tr '\n' ' ')"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    if command -v sinfo >/dev/null 2>&1; then
        skip "SLURM is installed but its controller does not answer, and starting it needs root (sudo sh .ci/install_slurm.sh)"
    fi
    skip "SLURM is not installed and installing it needs root (sudo sh .ci/install_slurm.sh)"
fi
if ! command -v apt-get >/dev/null 2>&1 || ! command -v dpkg >/dev/null 2>&1; then
    skip "not a Debian/Ubuntu machine: .ci/install_slurm.sh cannot install or start SLURM here"
fi
missing=""
for pkg in munge slurmctld slurmd slurm-client; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing="$missing $pkg"
done
if [ -n "$missing" ] && [ "${REGENT_INSTALL_SLURM:-0}" != 1 ]; then
    skip "packages not installed:$missing (install and start them with: sudo sh .ci/install_slurm.sh, or run REGENT_INSTALL_SLURM=1 make test)"
fi
say "starting the single-node SLURM cluster (.ci/install_slurm.sh)"
if command -v timeout >/dev/null 2>&1; then
    timeout 600 sh .ci/install_slurm.sh || skip ".ci/install_slurm.sh failed (exit $?); see its output above and /var/log/slurm/"
else
    sh .ci/install_slurm.sh || skip ".ci/install_slurm.sh failed (exit $?); see its output above and /var/log/slurm/"
fi
usable || skip "SLURM started but no node is usable; see /var/log/slurm/slurmctld.log"
exit 0
