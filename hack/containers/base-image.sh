#!/usr/bin/env bash
# Builds (once) the Debian base image every ctj image starts from, without a registry:
# debootstrap's minbase of Debian bookworm from the Debian mirror apt uses, imported into
# Docker as ctj/debian:bookworm. Prints the image name.
#
# The image trusts the host's extra CA certificates (/usr/local/share/ca-certificates), so
# pip and apt over HTTPS work in builds on machines behind a TLS-inspecting egress proxy.
#
# Cached by its inputs: the image carries a label with the hash of the suite, variant,
# mirror and those certificates; an image with the right label is reused (a no-op), any
# other is rebuilt.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
DOCKER=/usr/bin/docker
suite=bookworm variant=minbase
mirror="${CTJ_DEBIAN_MIRROR:-$(sed -n 's#^URIs: *\(http[^ ]*debian\)$#\1#p' \
  /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -n1)}"
mirror="${mirror:-http://deb.debian.org/debian}"
image="ctj/debian:$suite"
extra_cas=(/usr/local/share/ca-certificates/*.crt)
[ -e "${extra_cas[0]}" ] || extra_cas=()
key="$( { printf '%s\n' "$suite" "$variant" "$mirror"; cat "${extra_cas[@]}" /dev/null; } \
        | sha256sum | cut -c1-12)"
log() { printf 'base-image: %s\n' "$*" >&2; }

"$here/docker.sh"
have="$("$DOCKER" image inspect -f '{{index .Config.Labels "ctj.inputs"}}' "$image" 2>/dev/null || true)"
if [ "$have" = "$key" ]; then echo "$image"; exit 0; fi

root="$(mktemp -d "${TMPDIR:-/tmp}/ctj-debootstrap.XXXXXX")"
trap 'rm -rf "$root"' EXIT
log "debootstrap --variant=$variant $suite from $mirror (about a minute)"
debootstrap --variant="$variant" --include=ca-certificates "$suite" "$root" "$mirror" >"$root.log" 2>&1 \
  || { tail -n 20 "$root.log" >&2; rm -f "$root.log"; exit 1; }
rm -f "$root.log"
# The image's apt reads the same mirror; no caches, no docs kept.
printf 'deb %s %s main\ndeb %s %s-updates main\n' "$mirror" "$suite" "$mirror" "$suite" \
  > "$root/etc/apt/sources.list"
if (( ${#extra_cas[@]} )); then
  cp "${extra_cas[@]}" "$root/usr/local/share/ca-certificates/"
  chroot "$root" update-ca-certificates >/dev/null
fi
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | "$DOCKER" import --change "LABEL ctj.inputs=$key" \
  --change 'CMD ["/bin/bash"]' - "$image" >/dev/null
log "built $image"
echo "$image"
