#!/usr/bin/env bash
# One containerd image store on the host, shared by every kind node through hardlinks, so
# a big image (ctj's trainer: ~6 GB) is held once on disk however many nodes there are.
#
#   store.sh add IMAGE...            put local Docker images into the store (skips those whose
#                                    Docker image ID is already there). Docker's overlay2 layer
#                                    directories are unpacked layers already: each missing layer
#                                    becomes a snapshot filled with hardlinks to Docker's own
#                                    files (no copy, no `docker save`); the image record is made
#                                    from Docker's config blob. Where that cannot work (another
#                                    storage driver, another filesystem) or with
#                                    CTJ_KIND_STORE_IMPORT=save: `docker save | ctr import`.
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
#   store.sh drop IMAGE...           drop the images named
#   store.sh du [--docker]           disk used by the store and the node copies, hardlinks once;
#                                    --docker: and how much of it is beyond Docker's own layers
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

# ---- snapshots and image records, through any containerd's ctr --------------------
# C=(ctr command with -n k8s.io) and MAP_FROM/MAP_TO (the snapshot root as that containerd
# sees it / as this host does) say which containerd: the store's (same paths) or a node's.

# link_tree SRC DEST: `cp -al SRC/. DEST/`. link(2) refuses to cross mounts (EXDEV) even
# within one filesystem, and here /var/lib/docker is a bind mount of a directory of the root
# filesystem: then the links are made through one bind of that filesystem's root, in a
# mount namespace of their own (nothing is mounted for anyone else).
link_tree() {
  local src="$1" dst="$2" ms md dev_s dev_d root_s root_d top view="$run_dir/fsview"
  ms="$(findmnt -n -o TARGET -T "$src")"; md="$(findmnt -n -o TARGET -T "$dst")"
  if [ "$ms" = "$md" ]; then cp -al "$src/." "$dst/"; return; fi
  read -r dev_s root_s < <(findmnt -n -o MAJ:MIN,FSROOT -T "$src")
  read -r dev_d root_d < <(findmnt -n -o MAJ:MIN,FSROOT -T "$dst")
  [ "$dev_s" = "$dev_d" ] || { log "$src and $dst are on different filesystems"; return 1; }
  top="$(findmnt -n -r -o TARGET,FSROOT,MAJ:MIN | awk -v d="$dev_s" '$3 == d && $2 == "/" { print $1; exit }')"
  [ -n "$top" ] || { log "no mount of the whole filesystem $dev_s"; return 1; }
  # paths from the filesystem's root
  src="${root_s%/}/${src#"${ms%/}"/}"; dst="${root_d%/}/${dst#"${md%/}"/}"
  mkdir -p "$view"
  unshare -m --propagation private sh -c 'mount --bind "$1" "$2" && cp -al "$2$3/." "$2$4/"' \
    _ "$top" "$view" "$src" "$dst"
}

# fill_chain CHAIN_CSV SRC_DIR...: for each layer (bottom first) whose chain ID is not a
# snapshot yet: prepare one on its parent, hardlink SRC_DIR's files into it, commit it
# under the chain ID (a GC root until an image refers to it). Prints how many were new.
fill_chain() {
  local chain_csv="$1"; shift
  local srcs=("$@") ids i c parent="" key mounts up new=0
  IFS=, read -r -a ids <<<"$chain_csv"
  (( ${#srcs[@]} == ${#ids[@]} )) || die "${#ids[@]} layers but ${#srcs[@]} directories"
  for i in "${!ids[@]}"; do
    c="${ids[$i]}"
    if "${C[@]}" snapshots --snapshotter overlayfs info "$c" >/dev/null 2>&1; then
      parent="$c"; continue
    fi
    key="ctj-fill-$$-$i"
    mounts="$("${C[@]}" snapshots --snapshotter overlayfs prepare --mounts "$key" ${parent:+"$parent"})"
    # {Type, Source, Options}: a bind of the new dir (no parent), or an overlay's upperdir
    up="$(jq -r '.[0] | if .Type == "bind" then .Source else
          (.Options[] | select(startswith("upperdir=")) | ltrimstr("upperdir=")) end' <<<"$mounts")"
    [[ "$up" == "$MAP_FROM"/* ]] || die "unexpected snapshot path $up"
    up="$MAP_TO/${up#"$MAP_FROM"/}"
    if [ ! -d "$up" ] || [ -n "$(ls -A "$up")" ]; then
      "${C[@]}" snapshots --snapshotter overlayfs rm "$key" >/dev/null 2>&1 || true
      die "$up is not an empty snapshot directory"
    fi
    if ! link_tree "${srcs[$i]}" "$up"; then
      "${C[@]}" snapshots --snapshotter overlayfs rm "$key" >/dev/null 2>&1 || true
      die "hardlinking ${srcs[$i]} into $up failed"
    fi
    "${C[@]}" snapshots --snapshotter overlayfs commit "$c" "$key"
    "${C[@]}" snapshots --snapshotter overlayfs label "$c" "containerd.io/gc.root=ctj-fill" >/dev/null
    parent="$c"; new=$((new + 1))
  done
  echo "$new"
}
unroot_chain() {
  local c ids
  IFS=, read -r -a ids <<<"$1"
  for c in "${ids[@]}"; do
    "${C[@]}" snapshots --snapshotter overlayfs label "$c" "containerd.io/gc.root=" >/dev/null 2>&1 || true
  done
}

# import_record NAME MANIFEST_FILE CONFIG_FILE: the image record, from an OCI archive with
# the manifest and config only; the unpack that follows finds every layer in place.
import_record() {
  local name="$1" manifest="$2" config="$3" tmp md cd mt
  tmp="$(mktemp -d)"
  mkdir -p "$tmp/blobs/sha256"
  md="sha256:$(sha256sum < "$manifest" | cut -c1-64)"
  cd="sha256:$(sha256sum < "$config" | cut -c1-64)"
  cp "$manifest" "$tmp/blobs/sha256/${md#sha256:}"
  cp "$config" "$tmp/blobs/sha256/${cd#sha256:}"
  printf '{"imageLayoutVersion":"1.0.0"}' > "$tmp/oci-layout"
  mt="$(jq -r '.mediaType // "application/vnd.oci.image.manifest.v1+json"' "$manifest")"
  jq -n --arg d "$md" --arg n "$name" --arg mt "$mt" --argjson s "$(stat -c %s "$manifest")" \
    '{schemaVersion: 2, manifests: [{mediaType: $mt, digest: $d, size: $s,
      annotations: {"io.containerd.image.name": $n, "org.opencontainers.image.ref.name": ($n | split(":") | last)}}]}' \
    > "$tmp/index.json"
  tar -C "$tmp" -cf - oci-layout index.json blobs \
    | "${C[@]}" images import --all-platforms --snapshotter=overlayfs - >/dev/null
  rm -rf "$tmp"
}

# ---- add ------------------------------------------------------------------------------
docker_root=""
# docker_dirs IMG ID: prints the image's overlay2 layer directories, bottom first, when its
# layers can be hardlinked from Docker's storage (returns 1 otherwise: docker save it)
docker_dirs() {
  local img="$1" id="$2" info dirs=() d
  info="$("$DOCKER" image inspect -f '{{json .}}' "$img")" || return 1
  [ "$(jq -r '.GraphDriver.Name' <<<"$info")" = overlay2 ] || return 1
  # UpperDir is the top layer, LowerDir the rest, top first
  mapfile -t dirs < <(jq -r '[.GraphDriver.Data.UpperDir] + ((.GraphDriver.Data.LowerDir // "") | split(":"))
    | map(select(. != "")) | reverse | .[]' <<<"$info")
  (( ${#dirs[@]} == $(jq '.RootFS.Layers | length' <<<"$info") )) || return 1
  for d in "${dirs[@]}"; do [ -d "$d" ] || return 1; done
  # hardlinks need one filesystem
  [ "$(stat -c %d "${dirs[0]}")" = "$(stat -c %d "$root")" ] || return 1
  local cfg="$docker_root/image/overlay2/imagedb/content/sha256/${id#sha256:}"
  [ -f "$cfg" ] && [ "sha256:$(sha256sum < "$cfg" | cut -c1-64)" = "$id" ] || return 1
  printf '%s\n' "${dirs[@]}"
}

# add_from_docker IMG NAME ID DIR...: the image's layers straight from Docker's overlay2
# directories (docker_dirs), its record from Docker's config blob
add_from_docker() {
  local img="$1" name="$2" id="$3"; shift 3
  local dirs=("$@") diffs chain="" prev="" d i tmp
  local cfg="$docker_root/image/overlay2/imagedb/content/sha256/${id#sha256:}"
  mapfile -t diffs < <("$DOCKER" image inspect -f '{{range .RootFS.Layers}}{{println .}}{{end}}' "$img" | sed '/^$/d')
  local ids=() sizes=()
  for d in "${diffs[@]}"; do
    if [ -z "$prev" ]; then prev="$d"; else prev="sha256:$(printf '%s %s' "$prev" "$d" | sha256sum | cut -c1-64)"; fi
    ids+=("$prev")
    sizes+=("$(cat "$docker_root/image/overlay2/layerdb/sha256/${prev#sha256:}/size" 2>/dev/null || echo 0)")
  done
  chain="$(IFS=,; echo "${ids[*]}")"
  local new
  new="$(fill_chain "$chain" "${dirs[@]}")"
  tmp="$(mktemp)"
  jq -n --arg cd "$id" --argjson cs "$(stat -c %s "$cfg")" \
    --argjson layers "$(for i in "${!diffs[@]}"; do printf '{"d":"%s","s":%s}\n' "${diffs[$i]}" "${sizes[$i]}"; done | jq -s .)" \
    '{schemaVersion: 2, mediaType: "application/vnd.docker.distribution.manifest.v2+json",
      config: {mediaType: "application/vnd.docker.container.image.v1+json", size: $cs, digest: $cd},
      layers: [$layers[] | {mediaType: "application/vnd.docker.image.rootfs.diff.tar", size: .s, digest: .d}]}' \
    > "$tmp"
  import_record "$name" "$tmp" "$cfg"
  rm -f "$tmp"
  unroot_chain "$chain"
  log "$name: from Docker's layers ($new of ${#ids[@]} new, hardlinked)"
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
  C=("${CTR[@]}") MAP_FROM="$root" MAP_TO="$root"
  docker_root="$("$DOCKER" info -f '{{.DockerRootDir}}')"
  local start size saved=()
  start=$(date +%s)
  size="$("$DOCKER" image inspect -f '{{.Size}}' "${want[@]}" | awk '{ s += $1 } END { printf "%.1f", s / 1e9 }')"
  log "adding ${want[*]} (${size} GB as Docker counts it) to the store"
  for img in "${want[@]}"; do
    name="$(normalize "$img")"
    id="$("$DOCKER" image inspect -f '{{.Id}}' "$img")"
    local dirs
    if [ "${CTJ_KIND_STORE_IMPORT:-}" != save ] && dirs="$(docker_dirs "$img" "$id")"; then
      mapfile -t dirs <<<"$dirs"
      add_from_docker "$img" "$name" "$id" "${dirs[@]}"
    else
      saved+=("$img")
    fi
  done
  if (( ${#saved[@]} )); then
    log "docker save | ctr import: ${saved[*]}"
    "$DOCKER" save "${saved[@]}" \
      | nice -n "${CTJ_BUILD_NICE:-10}" "${CTR[@]}" images import --all-platforms --digests \
          --snapshotter=overlayfs - >/dev/null
  fi
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
  log "added in $(( $(date +%s) - start ))s"
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
  # the digest-named records `ctr import --digests` adds
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

# snapshot_dirs CHAIN_ID: the store's snapshot directories of that chain, bottom first
snapshot_dirs() {
  local top="$1" key="ctj-view-$$" m
  m="$("${CTR[@]}" snapshots --snapshotter overlayfs view --mounts "$key" "$top")"
  "${CTR[@]}" snapshots --snapshotter overlayfs rm "$key" >/dev/null 2>&1 || true
  # a bind of one dir, or an overlay's lowerdir=top:...:bottom
  jq -r '.[0] | if .Type == "bind" then .Source else
         (.Options[] | select(startswith("lowerdir=")) | ltrimstr("lowerdir=") | split(":") | reverse | .[])
         end' <<<"$m"
}

cmd_link() {
  local node="$1" dir="$2"; shift 2
  local img name line id target chain top dirs=() new tmp_m tmp_c
  for img in "$@"; do
    name="$(normalize "$img")"
    line="$(indexed "$name")"
    [ -n "$line" ] || die "$img is not in the store"
    IFS=$'\t' read -r _ id target chain _ <<<"$line"
    C=("$DOCKER" exec -i "$node" ctr -n k8s.io)
    if [ "$("${C[@]}" images ls "name==$name" 2>/dev/null | awk 'NR > 1 { print $3 }')" = "$target" ]; then
      continue
    fi
    start_store
    top="${chain##*,}"
    C=("${CTR[@]}")
    mapfile -t dirs < <(snapshot_dirs "$top")
    tmp_m="$(mktemp)" tmp_c="$(mktemp)"
    "${CTR[@]}" content get "$target" > "$tmp_m"
    "${CTR[@]}" content get "$(jq -r '.config.digest' "$tmp_m")" > "$tmp_c"
    C=("$DOCKER" exec -i "$node" ctr -n k8s.io) MAP_FROM="$in_node_root" MAP_TO="$dir"
    new="$(fill_chain "$chain" "${dirs[@]}")"
    import_record "$name" "$tmp_m" "$tmp_c"
    unroot_chain "$chain"
    rm -f "$tmp_m" "$tmp_c"
    log "$node: $name linked ($new of $(tr , '\n' <<<"$chain" | wc -l) layers were new)"
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

cmd_drop() {
  local n name
  start_store
  for n in "$@"; do
    name="$(normalize "$n")"
    [ -n "$(indexed "$name")" ] || continue
    "${CTR[@]}" images rm --sync "$name" >/dev/null 2>&1 || true
    awk -F'\t' -v n="$name" '$1 != n' "$index" > "$index.tmp" && mv "$index.tmp" "$index"
    log "dropped $name"
  done
}

cmd_du() {
  local dirs=("$root") d
  for d in "$cache"/kind/nodes/*/*/containerd; do [ -d "$d" ] && dirs+=("$d"); done
  du -sh "${dirs[@]}" 2>/dev/null | sed "s#$cache/##"
  du -shc "${dirs[@]}" 2>/dev/null | tail -n1 | sed 's/total/total, each file once/'
  if [ "${1:-}" = --docker ]; then
    # the store's files are mostly Docker's own layer files: what kind adds to Docker's disk
    local dk all
    dk="$(du -sb "$("$DOCKER" info -f '{{.DockerRootDir}}')/overlay2" | cut -f1)"
    all="$(du -sbc "$("$DOCKER" info -f '{{.DockerRootDir}}')/overlay2" "${dirs[@]}" 2>/dev/null | tail -n1 | cut -f1)"
    awk -v a="$all" -v d="$dk" 'BEGIN { printf "%.2f GB\tbeyond what Docker holds itself (its overlay2: %.2f GB)\n", (a - d) / 1e9, d / 1e9 }'
  fi
}

sub="${1:-}"; shift || true
case "$sub" in
  add) cmd_add "$@" ;;
  clone) cmd_clone "$@" ;;
  link) cmd_link "$@" ;;
  list) cmd_list ;;
  prune) cmd_prune "$@" ;;
  drop) cmd_drop "$@" ;;
  du) cmd_du "$@" ;;
  *) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//' >&2; exit 2 ;;
esac
