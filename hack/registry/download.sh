# shellcheck shell=bash
# Download-or-build for the Go binaries of hack/cluster-binaries.sh that upstream publishes
# pre-built at the very versions hack/versions.env pins (docs/registry.md, "Pre-built
# binaries"). Sourced by hack/cluster-binaries.sh (after hack/versions.env), which calls
#
#   download_tool NAME VERSION DIR   0: DIR/bin holds NAME's binaries, downloaded and checked
#                                    against the published sha256, and DIR/.complete exists;
#                                    1: build it as before, $DL_WHY says why not
#   download_pick BUILT_DIR DL_DIR   prints the directory to use: a complete BUILT_DIR, else a
#                                    complete DL_DIR (unless downloads are off), else
#                                    BUILT_DIR (what a build makes). No network.
#
# NAMEs: k8s (kube-apiserver, kube-controller-manager, kube-scheduler, kubectl), k8s-node
# (kubelet, kubeadm, kube-proxy, kubectl), etcd, helm, kind, crictl; any other NAME has no
# published binary (DL_WHY says so). The binaries installed are the ones the build makes,
# under the same names. Settings:
#   CTJ_DOWNLOAD=auto    (default: $CTJ_PULL, else auto) download where the site answers,
#                        else build
#               never    build here, as on a machine with no network (and do not use a
#                        directory downloaded earlier)
#               always   never compile: use what is cached, else download, and fail
#                        (exit 1) rather than build
#   CTJ_DL_K8S=URL       base URL of dl.k8s.io        (default https://dl.k8s.io)
#   CTJ_DL_GITHUB=URL    base URL of github.com       (default https://github.com; etcd, kind,
#                        crictl: URL/<owner>/<repo>/releases/download/<tag>/<file>)
#   CTJ_DL_HELM=URL      base URL of get.helm.sh      (default https://get.helm.sh)
#   CTJ_DOWNLOAD_MIRROR=URL   one mirror for the three: URL/dl.k8s.io/..., URL/github.com/...,
#                        URL/get.helm.sh/... (a CTJ_DL_* setting wins over it)
#   CTJ_DL_PROBE_TIMEOUT seconds the reachability probe waits (default $CTJ_PULL_PROBE_TIMEOUT,
#                        else 3)
#   CTJ_DL_TIMEOUT       seconds one file's download may take (default 600)
#
# Each base URL is probed once per process (a HEAD of URL/: any HTTP answer counts), so with
# no network the default path costs a DNS failure or the probe timeout, never a hang. Every
# file is checked against the sha256 its project publishes beside it (URL.sha256,
# URL.sha256sum or the release's SHA256SUMS, fetched from the same base URL); a file whose
# sum differs, or has none, is refused: nothing is installed, and the build runs instead.

DL_WHY=""
# shellcheck source=hack/registry/probe.sh
source "$(dirname "${BASH_SOURCE[0]}")/probe.sh"
declare -gA _dl_probed=()   # base URL -> "yes", or why not

dl_log() { printf 'download: %s\n' "$*" >&2; }

# dl_mode: auto, never or always (exits 2 on anything else)
dl_mode() {
  local mode="${CTJ_DOWNLOAD:-${CTJ_PULL:-auto}}"
  case "$mode" in
    auto|never|always) echo "$mode" ;;
    *) dl_log "CTJ_DOWNLOAD=$mode is none of auto, never, always"; exit 2 ;;
  esac
}

# dl_base SITE: the base URL files of SITE (dl.k8s.io, github.com, get.helm.sh) come from
dl_base() {
  local site="$1" var
  case "$site" in
    dl.k8s.io) var=CTJ_DL_K8S ;;
    github.com) var=CTJ_DL_GITHUB ;;
    get.helm.sh) var=CTJ_DL_HELM ;;
    *) return 1 ;;
  esac
  if [ -n "${!var:-}" ]; then echo "${!var%/}"
  elif [ -n "${CTJ_DOWNLOAD_MIRROR:-}" ]; then echo "${CTJ_DOWNLOAD_MIRROR%/}/$site"
  else echo "https://$site"; fi
}

# dl_arch: Go's name of this machine's architecture, if upstream publishes binaries for it
dl_arch() {
  [ "$(uname -s)" = Linux ] || return 1
  case "$(uname -m)" in
    x86_64|amd64) echo amd64 ;;
    aarch64|arm64) echo arm64 ;;
    *) return 1 ;;
  esac
}

# dl_reachable BASE: whether BASE answers HTTP at all (probed once; why not in DL_WHY)
dl_reachable() {
  local base="$1" why t="${CTJ_DL_PROBE_TIMEOUT:-${CTJ_PULL_PROBE_TIMEOUT:-3}}"
  if [ -z "${_dl_probed[$base]:-}" ]; then
    if why="$(http_probe "$base" "$base/" "$t" -I)"; then why=yes; fi
    _dl_probed[$base]="$why"
  fi
  [ "${_dl_probed[$base]}" = yes ] && return 0
  DL_WHY="${_dl_probed[$base]}"
  return 1
}

# _dl_get URL FILE: download URL to FILE (redirects followed; why not in DL_WHY)
_dl_get() {
  local url="$1" out="$2" code rc=0 t="${CTJ_DL_PROBE_TIMEOUT:-${CTJ_PULL_PROBE_TIMEOUT:-3}}"
  # the site answered the probe: allow a slower connection (to a redirect's target)
  if ! [[ "$t" =~ ^[0-9]+$ ]] || (( t < 10 )); then t=10; fi
  code="$(curl -sSL -f -o "$out" -w '%{http_code}' --retry 2 --retry-delay 1 \
          --connect-timeout "$t" --max-time "${CTJ_DL_TIMEOUT:-600}" "$url" 2>/dev/null)" || rc=$?
  (( rc == 0 )) && return 0
  if [ "$rc" = 22 ]; then DL_WHY="GET $url: HTTP $code"; else DL_WHY="GET $url: curl exit $rc"; fi
  return 1
}

# _dl_expected SUMS FILENAME: the sha256 that SUMS (a bare hash, or "HASH  NAME" lines as
# sha256sum writes them) gives for FILENAME
_dl_expected() {
  awk -v f="$2" '
    { n = $2; sub(/^\*/, "", n); sub(/^\.\//, "", n) }
    NF >= 2 && n == f { print tolower($1); found = 1; exit }
    NR == 1 && NF == 1 { one = tolower($1) }
    END { if (!found && one != "") print one }' "$1"
}

# _dl_plan NAME VERSION ARCH: the files of NAME, one line each:
#   URL SUMS_URL MEMBER BINARY   (MEMBER: the path inside the .tar.gz at URL, or - for a
#                                 plain file; BINARY: the name it is installed under in bin/)
_dl_plan() {
  local name="$1" v="$2" arch="$3" k8s gh helm b url
  k8s="$(dl_base dl.k8s.io)" gh="$(dl_base github.com)" helm="$(dl_base get.helm.sh)"
  case "$name" in
    k8s|k8s-node)
      local bins=(kube-apiserver kube-controller-manager kube-scheduler kubectl)
      [ "$name" = k8s ] || bins=(kubelet kubeadm kube-proxy kubectl)
      for b in "${bins[@]}"; do
        url="$k8s/release/$v/bin/linux/$arch/$b"
        echo "$url $url.sha256 - $b"
      done ;;
    etcd)
      url="$gh/etcd-io/etcd/releases/download/$v"
      echo "$url/etcd-$v-linux-$arch.tar.gz $url/SHA256SUMS etcd-$v-linux-$arch/etcd etcd" ;;
    helm)
      url="$helm/helm-$v-linux-$arch.tar.gz"
      echo "$url $url.sha256sum linux-$arch/helm helm" ;;
    kind)
      url="$gh/kubernetes-sigs/kind/releases/download/$v/kind-linux-$arch"
      echo "$url $url.sha256sum - kind" ;;
    crictl)
      url="$gh/kubernetes-sigs/cri-tools/releases/download/$v/crictl-$v-linux-$arch.tar.gz"
      echo "$url $url.sha256 crictl crictl" ;;
    *) return 1 ;;
  esac
}

# _dl_base_of URL: scheme://host[:port][/path] of the configured base URL URL starts with
_dl_base_of() {
  local site base
  for site in dl.k8s.io github.com get.helm.sh; do
    base="$(dl_base "$site")"
    case "$1" in "$base"/*) echo "$base"; return 0 ;; esac
  done
  return 1
}

# _dl_files NAME VERSION DIR WORK: download, check and install into DIR.tmp (DL_WHY on failure)
_dl_files() {
  local name="$1" v="$2" dir="$3" work="$4" arch plan url sums member bin base file sumfile
  local want have n=0
  arch="$(dl_arch)" || { DL_WHY="no published binary for $(uname -s)/$(uname -m)"; return 1; }
  plan="$(_dl_plan "$name" "$v" "$arch")" || { DL_WHY="$name has no published binary"; return 1; }
  while read -r url sums member bin; do
    base="$(_dl_base_of "$url")"
    dl_reachable "$base" || return 1
  done <<< "$plan"
  if ! { rm -rf "$dir.tmp" && mkdir -p "$dir.tmp/bin" "$work/x"; }; then
    DL_WHY="cannot create $dir.tmp"; return 1
  fi
  while read -r url sums member bin; do
    n=$((n + 1))
    file="$work/$n-${url##*/}"
    sumfile="$work/sums-$(printf '%s' "$sums" | sha256sum | cut -c1-16)"
    [ -s "$sumfile" ] || _dl_get "$sums" "$sumfile" || return 1
    want="$(_dl_expected "$sumfile" "${url##*/}")"
    if ! [[ "$want" =~ ^[0-9a-f]{64}$ ]]; then
      DL_WHY="no sha256 for ${url##*/} in $sums"; return 1
    fi
    _dl_get "$url" "$file" || return 1
    have="$(sha256sum "$file" | cut -d' ' -f1)"
    if [ "$have" != "$want" ]; then
      DL_WHY="CHECKSUM MISMATCH for $url: sha256 $have, $sums says $want"
      dl_log "$name $v: $DL_WHY: refused, nothing installed"
      return 1
    fi
    if [ "$member" != - ]; then
      if ! tar -xzf "$file" -C "$work/x" "$member" 2>/dev/null || [ ! -f "$work/x/$member" ]; then
        DL_WHY="${url##*/} has no $member"; return 1
      fi
      file="$work/x/$member"
    fi
    { mv "$file" "$dir.tmp/bin/$bin" && chmod 0755 "$dir.tmp/bin/$bin"; } \
      || { DL_WHY="cannot install $bin into $dir.tmp/bin"; return 1; }
    printf '%s %s\n' "$want" "$url" >> "$dir.tmp/.source"
  done <<< "$plan"
  # the caller's extras_dl_NAME DIR: what else the directory must hold before it counts
  if declare -F "extras_dl_$name" >/dev/null && ! "extras_dl_$name" "$dir.tmp"; then
    DL_WHY="extras_dl_$name failed"; return 1
  fi
}

# download_tool NAME VERSION DIR: see the top
download_tool() {
  local name="$1" v="$2" dir="$3" mode work start rc=0
  DL_WHY=""
  mode="$(dl_mode)" || exit 2
  if [ "$mode" = never ]; then DL_WHY="CTJ_DOWNLOAD=never"; return 1; fi
  start=$(date +%s)
  # the downloads sit beside DIR (the same file system, not a small /tmp), removed at the end
  if ! mkdir -p "$(dirname "$dir")" || ! work="$(mktemp -d "$dir.download.XXXXXX")"; then
    DL_WHY="cannot create a directory beside $dir"; return 1
  fi
  _dl_files "$name" "$v" "$dir" "$work" || rc=1
  rm -rf "$work"
  if (( rc == 0 )) && rm -rf "$dir" && mv "$dir.tmp" "$dir" && date -u +%FT%TZ > "$dir/.complete"
  then
    dl_log "$name $v: downloaded and verified into $dir ($(( $(date +%s) - start ))s)"
    return 0
  fi
  rm -rf "$dir.tmp"
  [ -n "$DL_WHY" ] || DL_WHY="cannot move $dir.tmp to $dir"
  if [ "$mode" = always ]; then
    dl_log "CTJ_DOWNLOAD=always and $name $v could not be downloaded: $DL_WHY"
    dl_log "(CTJ_DOWNLOAD=auto builds it here instead; or set CTJ_DOWNLOAD_MIRROR / CTJ_DL_*)"
    exit 1
  fi
  dl_log "$name $v: not downloaded ($DL_WHY): building it from source"
  return 1
}

# download_pick BUILT_DIR DL_DIR: see the top
download_pick() {
  local mode
  mode="$(dl_mode)" || exit 2
  if [ -f "$1/.complete" ]; then echo "$1"
  elif [ "$mode" != never ] && [ -f "$2/.complete" ]; then echo "$2"
  else echo "$1"; fi
}
