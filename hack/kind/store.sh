#!/usr/bin/env bash
# One containerd image store on the host, shared by every kind node through hardlinks, so
# a big image (ctj's trainer: ~6 GB) is held once on disk however many nodes there are.
#
#   store.sh add IMAGE...            put local Docker images into the store (skips those whose
#                                    Docker image ID is already there)
#   store.sh clone DIR               make DIR a node's /var/lib/containerd: `cp -al` of the store
#                                    (image snapshots are read-only overlay lowerdirs, so nodes
#                                    can share their files) with real copies of the bolt DBs
#   store.sh link NODE DIR IMAGE...  make images in the store present in the running node NODE
#                                    (a kind node container) whose /var/lib/containerd is DIR:
#                                    each missing layer is a snapshot prepared by the node's
#                                    containerd, filled with hardlinks from the store, committed
#                                    under its chain ID; then the image record (manifest and
#                                    config only) is imported, and containerd's unpack finds
#                                    every layer already there
#   store.sh list                    the images in the store (name, Docker image ID, size)
#   store.sh prune [IMAGE...]        drop every image not named (and what only it used)
#   store.sh du                      disk used by the store and the node copies, hardlinks once
#
# The store is ${CTJ_CACHE:-~/.cache/ctj}/kind/store: root/ (a containerd root, written only by a
# containerd this script starts on it with its own socket, never while it is being cloned:
# one flock), images.tsv (what is in it). Layer blobs are dropped once unpacked (as kind's
# containerd does with discard_unpacked_layers): the snapshots are what containers run from.
# Needs the host's containerd and ctr (Debian containerd 1.6.20, the nodes' own version).
set -euo pipefail
kind_dir="$(cd "$(dirname "$0")" && pwd)"
cache="${CTJ_CACHE:-$HOME/.cache/ctj}"
store="$cache/kind/store"
root="$store/root"
index="$store/images.tsv"
run_dir="/run/ctj-kind-store"
sock="$run_dir/containerd.sock"
DOCKER=/usr/bin/docker
CTR=(/usr/bin/ctr -a "$sock" -n k8s.io)
in_node_root=/var/lib/containerd
log() { printf 'kind-store: %s\n' "$*" >&2; }
die() { log "$*"; exit 1; }

mkdir -p "$store"
touch "$index"
exec 9>"$store/.lock"
flock 9

# ---- the store's own containerd (only while adding or pruning) ----------------------
store_pid=""
start_store() {
  [ -z "$store_pid" ] || return 0
  mkdir -p "$root" "$run_dir"
  cat > "$store/containerd.toml" <<EOF
version = 2
root = "$root"
state = "$run_dir/state"
disabled_plugins = ["io.containerd.grpc.v1.cri", "io.containerd.snapshotter.v1.aufs",
  "io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.devmapper",
  "io.containerd.snapshotter.v1.zfs", "io.containerd.internal.v1.opt",
  "io.containerd.tracing.processor.v1.otlp"]
[grpc]
  address = "$sock"
[ttrpc]
  address = "$sock.ttrpc"
EOF
  containerd --config "$store/containerd.toml" >>"$store/containerd.log" 2>&1 &
  store_pid=$!
  for _ in $(seq 1 100); do
    if "${CTR[@]}" version >/dev/null 2>&1; then return 0; fi
    kill -0 "$store_pid" 2>/dev/null || break
    sleep 0.1
  done
  tail -n 20 "$store/containerd.log" >&2
  die "the store's containerd did not start"
}
stop_store() {
  [ -n "$store_pid" ] || return 0
  kill "$store_pid" 2>/dev/null || true
  wait "$store_pid" 2>/dev/null || true
  store_pid=""
}
trap stop_store EXIT

# normalize NAME: containerd's (and the kubelet's) full reference for a Docker name
normalize() {
  local n="$1" first="${1%%/*}"
  if [[ "$n" != */* ]]; then n="docker.io/library/$n"
  elif [[ "$first" != *.* && "$first" != *:* && "$first" != localhost ]]; then n="docker.io/$n"
  fi
  [[ "${n##*/}" == *:* || "$n" == *@* ]] || n="$n:latest"
  printf '%s' "$n"
}

# index lines: NAME <tab> DOCKER_ID <tab> MANIFEST_DIGEST <tab> CHAIN_IDS (comma separated)
#              <tab> SIZE (unpacked bytes)
indexed_id() { awk -F'\t' -v n="$1" '$1 == n { print $2 }' "$index"; }
indexed() { awk -F'\t' -v n="$1" '$1 == n' "$index"; }

# describe NAME (store running): MANIFEST CHAINIDS SIZE of an image in the store
describe() {
  local name="$1" target manifest config
  target="$("${CTR[@]}" images ls "name==$name" | awk 'NR > 1 { print $3 }')"
  [ -n "$target" ] || die "$name is not in the store after the import"
  manifest="$("${CTR[@]}" content get "$target")"
  if jq -e '.manifests' >/dev/null <<<"$manifest"; then  # an index: take linux/amd64
    target="$(jq -r '[.manifests[] | select((.platform.os // "linux") == "linux" and
      (.platform.architecture // "amd64") == "amd64")][0].digest' <<<"$manifest")"
    manifest="$("${CTR[@]}" content get "$target")"
  fi
  config="$(jq -r '.config.digest' <<<"$manifest")"
  local chain="" prev="" d ids=()
  for d in $("${CTR[@]}" content get "$config" | jq -r '.rootfs.diff_ids[]'); do
    if [ -z "$prev" ]; then prev="$d"; else prev="sha256:$(printf '%s %s' "$prev" "$d" | sha256sum | cut -c1-64)"; fi
    ids+=("$prev")
  done
  chain="$(IFS=,; echo "${ids[*]}")"
  printf '%s\t%s\t%s\n' "$target" "$chain" "$(jq '[.layers[].size] | add // 0' <<<"$manifest")"
}

cmd_add() {
  local want=() img id name
  for img in "$@"; do
    id="$("$DOCKER" image inspect -f '{{.Id}}' "$img" 2>/dev/null)" || die "no local Docker image $img"
    name="$(normalize "$img")"
    [ "$(indexed_id "$name")" = "$id" ] || want+=("$img")
  done
  (( ${#want[@]} )) || return 0
  start_store
  local start size
  start=$(date +%s)
  size="$("$DOCKER" image inspect -f '{{.Size}}' "${want[@]}" | awk '{ s += $1 } END { printf "%.1f", s / 1e9 }')"
  log "importing ${want[*]} (${size} GB as Docker counts it) into the store"
  "$DOCKER" save "${want[@]}" \
    | nice -n "${CTJ_BUILD_NICE:-10}" "${CTR[@]}" images import --all-platforms --digests \
        --snapshotter=overlayfs - >/dev/null
  for img in "${want[@]}"; do
    name="$(normalize "$img")"
    id="$("$DOCKER" image inspect -f '{{.Id}}' "$img")"
    local desc
    desc="$(describe "$name")"
    awk -F'\t' -v n="$name" '$1 != n' "$index" > "$index.tmp"
    printf '%s\t%s\t%s\n' "$name" "$id" "$desc" >> "$index.tmp"
    mv "$index.tmp" "$index"
  done
  discard_layers
  log "imported in $(( $(date +%s) - start ))s"
}

# the layer blobs of every image: unpacked snapshots are all a node needs
discard_layers() {
  local t m d
  for t in $(awk -F'\t' '{ print $3 }' "$index"); do
    m="$("${CTR[@]}" content get "$t")"
    for d in $(jq -r '.layers[]?.digest' <<<"$m"); do
      "${CTR[@]}" content rm "$d" >/dev/null 2>&1 || true
    done
  done
  # the digest-named records --digests adds, and ingests an interrupted import left
  "${CTR[@]}" images ls -q | grep -E '^import-[0-9-]+@sha256:' | xargs -r "${CTR[@]}" images rm >/dev/null 2>&1 || true
}

cmd_clone() {
  local dest="$1"
  [ -d "$root" ] || die "the store is empty: run store.sh add first"
  [ ! -e "$dest" ] || die "$dest exists"
  mkdir -p "$(dirname "$dest")"
  cp -al "$root" "$dest.tmp"
  # the bolt DBs change: each node gets its own (everything else is written once)
  (cd "$root" && find . -name '*.db' -type f) | while read -r db; do
    cp --remove-destination "$root/$db" "$dest.tmp/$db"
  done
  # containerd's server UUID: each node makes its own
  rm -f "$dest.tmp/io.containerd.grpc.v1.introspection/uuid"
  mv "$dest.tmp" "$dest"
}

# snapshot_dirs NAME: the store's snapshot directories of NAME's layers, bottom first
snapshot_dirs() {
  local top="$1" key="ctj-view-$$" m
  m="$("${CTR[@]}" snapshots --snapshotter overlayfs view --mounts "$key" "$top" 2>/dev/null \
       || "${CTR[@]}" snapshots --snapshotter overlayfs mounts /x "$key")"
  "${CTR[@]}" snapshots --snapshotter overlayfs rm "$key" >/dev/null 2>&1 || true
  # JSON mounts ({Type, Source, Options}): a bind of one dir, or overlay lowerdir=top:...:bottom
  jq -r '.[0] | if .Type == "bind" then .Source else
         (.Options[] | select(startswith("lowerdir=")) | ltrimstr("lowerdir=") | split(":") | reverse | .[])
         end' <<<"$m"
}

cmd_link() {
  local node="$1" dir="$2"; shift 2
  local nctr=("$DOCKER" exec -i "$node" ctr -n k8s.io) img name line
  for img in "$@"; do
    name="$(normalize "$img")"
    line="$(indexed "$name")"
    [ -n "$line" ] || die "$img is not in the store"
    local id target chain
    IFS=$'\t' read -r _ id target chain _ <<<"$line"
    if "${nctr[@]}" images ls -q "name==$name" 2>/dev/null | grep -qx "$name" \
       && [ "$("${nctr[@]}" images ls "name==$name" | awk 'NR > 1 { print $3 }')" = "$target" ]; then
      continue
    fi
    IFS=, read -r -a chain_ids <<<"$chain"
    local top="${chain_ids[${#chain_ids[@]}-1]}" dirs=() i parent="" key mounts up linked=0
    start_store
    mapfile -t dirs < <(snapshot_dirs "$top")
    (( ${#dirs[@]} == ${#chain_ids[@]} )) || die "$name: ${#chain_ids[@]} layers but ${#dirs[@]} snapshot dirs"
    for i in "${!chain_ids[@]}"; do
      local c="${chain_ids[$i]}"
      if "${nctr[@]}" snapshots --snapshotter overlayfs info "$c" >/dev/null 2>&1; then
        parent="$c"; continue
      fi
      key="ctj-link-$$-$i"
      mounts="$("${nctr[@]}" snapshots --snapshotter overlayfs prepare --mounts "$key" ${parent:+"$parent"})"
      up="$(jq -r '.[0] | if .Type == "bind" then .Source else
            (.Options[] | select(startswith("upperdir=")) | ltrimstr("upperdir=")) end' <<<"$mounts")"
      [[ "$up" == "$in_node_root"/* ]] || die "unexpected snapshot path $up in $node"
      up="$dir/${up#"$in_node_root"/}"
      [ -d "$up" ] && [ -z "$(ls -A "$up")" ] || die "$up is not an empty snapshot dir"
      cp -al "${dirs[$i]}/." "$up/"
      "${nctr[@]}" snapshots --snapshotter overlayfs commit "$c" "$key"
      # a GC root until the image record refers to it
      "${nctr[@]}" snapshots --snapshotter overlayfs label "$c" "containerd.io/gc.root=ctj-link" >/dev/null
      parent="$c"; linked=$((linked + 1))
    done
    # the image record: an OCI archive with the manifest and config only; the unpack
    # that follows the import finds every layer's snapshot in place
    local tmp m cfg
    tmp="$(mktemp -d)"
    mkdir -p "$tmp/blobs/sha256"
    m="$("${CTR[@]}" content get "$target")"
    printf '%s' "$m" > "$tmp/blobs/sha256/${target#sha256:}"
    cfg="$(jq -r '.config.digest' <<<"$m")"
    "${CTR[@]}" content get "$cfg" > "$tmp/blobs/sha256/${cfg#sha256:}"
    printf '{"imageLayoutVersion":"1.0.0"}' > "$tmp/oci-layout"
    jq -n --arg d "$target" --arg n "$name" --arg mt "$(jq -r '.mediaType // "application/vnd.oci.image.manifest.v1+json"' <<<"$m")" \
      --argjson s "$(stat -c %s "$tmp/blobs/sha256/${target#sha256:}")" \
      '{schemaVersion: 2, manifests: [{mediaType: $mt, digest: $d, size: $s,
        annotations: {"io.containerd.image.name": $n, "org.opencontainers.image.ref.name": ($n | split(":") | last)}}]}' \
      > "$tmp/index.json"
    tar -C "$tmp" -cf - oci-layout index.json blobs \
      | "${nctr[@]}" images import --all-platforms --snapshotter=overlayfs - >/dev/null
    rm -rf "$tmp"
    for c in "${chain_ids[@]}"; do
      "${nctr[@]}" snapshots --snapshotter overlayfs label "$c" "containerd.io/gc.root=" >/dev/null 2>&1 || true
    done
    log "$node: $name linked (${linked} of ${#chain_ids[@]} layers were new)"
  done
}

cmd_list() {
  awk -F'\t' '{ printf "%s\t%s\t%.2f GB\n", $1, substr($2, 8, 12), $5 / 1e9 }' "$index"
}

cmd_prune() {
  local keep=() n
  for n in "$@"; do keep+=("$(normalize "$n")"); done
  start_store
  for n in $(awk -F'\t' '{ print $1 }' "$index"); do
    if [[ " ${keep[*]} " != *" $n "* ]]; then
      "${CTR[@]}" images rm --sync "$n" >/dev/null 2>&1 || true
      awk -F'\t' -v n="$n" '$1 != n' "$index" > "$index.tmp" && mv "$index.tmp" "$index"
      log "dropped $n"
    fi
  done
}

cmd_du() {
  local dirs=("$root") d
  for d in "$cache"/kind/nodes/*/*/containerd; do [ -d "$d" ] && dirs+=("$d"); done
  du -sh "${dirs[@]}" 2>/dev/null | sed "s#$cache/##"
  du -shc "${dirs[@]}" 2>/dev/null | tail -n1 | sed 's/total/total on disk (each file once)/'
}

sub="${1:-}"; shift || true
case "$sub" in
  add) cmd_add "$@" ;;
  clone) cmd_clone "$@" ;;
  link) cmd_link "$@" ;;
  list) cmd_list ;;
  prune) cmd_prune "$@" ;;
  du) cmd_du ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
