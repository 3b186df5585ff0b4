#!/usr/bin/env bash
# Makes sure SoftHSM2 and OpenSC are installed: plugins/kms-pkcs11's tests run the PKCS#11
# plugin against SoftHSM2 tokens, and fail (never skip) without them. As root on Debian or
# Ubuntu it installs them with apt-get; otherwise it prints the one command to run and fails.
set -euo pipefail
if command -v softhsm2-util >/dev/null 2>&1 && command -v pkcs11-tool >/dev/null 2>&1; then
  exit 0
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "softhsm2/opensc not found: installing them (the PKCS#11 plugin's tests need them)"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq softhsm2 opensc
  exit 0
fi
echo "The PKCS#11 plugin's tests (plugins/kms-pkcs11) need SoftHSM2 and OpenSC. Install them, then run again:" >&2
echo "  sudo apt-get install -y softhsm2 opensc" >&2
exit 1
