#!/usr/bin/env bash
# System packages the sandbox backend (k3.sandbox) needs, installed with apt-get as root.
# Required: unshare(1) and the util-linux tools, ldd (libc-bin), a python3 to build the default
# image from. Optional: criu, probed by `k3 sandbox doctor` (where `criu check` fails, memory
# snapshots use k3's own REPL checkpoint), python3-doc, the HTML docs the offline web serves, and
# the microVM backend (k3.sandbox.vm): QEMU, a Debian guest kernel with its modules, a static
# busybox for the guest's initramfs and mkfs.ext4 for its root disk.
# Idempotent: when everything is present it does nothing and returns at once.
set -euo pipefail

required=(util-linux libc-bin python3 coreutils grep sed findutils diffutils)
optional=(criu python3-doc qemu-system-x86 linux-image-cloud-amd64 busybox-static e2fsprogs)

missing=()
for package in "${required[@]}" "${optional[@]}"; do
    if ! dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed"; then
        missing+=("$package")
    fi
done
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    echo "install-system-deps: need root to install: ${missing[*]}" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
for package in "${missing[@]}"; do
    if [[ " ${optional[*]} " == *" $package "* ]]; then
        apt-get install -y -qq --no-install-recommends "$package" >/dev/null \
            || echo "install-system-deps: optional package $package is not available here; continuing" >&2
    else
        apt-get install -y -qq --no-install-recommends "$package" >/dev/null
    fi
done
