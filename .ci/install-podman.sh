#!/bin/sh
# Installs what tests/test_cdi_podman.py needs (a real CDI consumer): Debian's podman,
# runc (crun refuses hybrid cgroups on these machines) and a static busybox for the image.
# Idempotent: does nothing when everything is already there. Needs root (or sudo) and apt.
set -eu

PACKAGES="podman runc busybox-static"

have_all() {
    command -v podman >/dev/null 2>&1 && command -v runc >/dev/null 2>&1 && [ -x /bin/busybox ] &&
        dpkg-query -W -f='${Status}' busybox-static 2>/dev/null | grep -q "ok installed"
}

if have_all; then
    echo "install-podman: podman, runc and busybox-static already installed"
    exit 0
fi

SUDO=""
if [ "$(id -u)" -ne 0 ]; then
    SUDO="sudo"
fi

export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
# shellcheck disable=SC2086
$SUDO apt-get install -y -qq $PACKAGES
podman --version
