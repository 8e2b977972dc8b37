#!/usr/bin/env bash
# Entrypoint of the kareus-megatron image: run the command as the unprivileged user `kareus`.
#
# Started as `kareus` (the image default): run the command as is, with no capabilities.
# Started as root (`docker run --user 0 --cap-add SYS_ADMIN ...`, for SM-clock locking through NVML):
# switch to `kareus` at once, keeping CAP_SYS_ADMIN as the only (ambient) capability, so the job never
# runs with root's uid and holds nothing but what nvmlDeviceSetGpuLockedClocks requires.
# Started as root without CAP_SYS_ADMIN: switch to `kareus` with no capabilities.
set -euo pipefail
user="${KAREUS_USER:-kareus}"

if [[ $# -eq 0 ]]; then set -- kareus env; fi
if [[ "$(id -u)" != 0 ]]; then
    exec "$@"
fi
cap_eff=$((16#$(awk '/^CapEff:/ {print $2}' /proc/self/status)))
if (( (cap_eff >> 21) & 1 )); then   # bit 21 = CAP_SYS_ADMIN
    caps="-all,+sys_admin"
else
    caps="-all"
fi
exec setpriv --reuid="$user" --regid="$user" --init-groups \
    --inh-caps="$caps" --ambient-caps="$caps" --bounding-set="$caps" -- "$@"
