"""Download-or-build for the cluster binaries (hack/registry/download.sh), on loopback.

This machine reaches none of dl.k8s.io, GitHub or get.helm.sh, so a static HTTP server on
127.0.0.1 (the handler ``python -m http.server`` runs, here in a thread, so that the test
can see which requests arrived) stands in for them, or for a corporate mirror of them:
each test lays out the files of the pinned versions under ``<its prefix>/dl.k8s.io/...``,
``.../github.com/...`` and ``.../get.helm.sh/...``, exactly where upstream publishes them,
with checksum files in upstream's formats. The "binaries" are tiny shell scripts printing
their name and version. Nothing compiles: the library's functions are called from bash as
hack/cluster-binaries.sh calls them, and the script itself runs with a temporary
CTJ_CACHE, CTJ_DOWNLOAD=always (fail rather than build) and GOPROXY=off.
"""

from __future__ import annotations

import hashlib
import io
import os
import platform
import secrets
import shutil
import socket
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "hack" / "cluster-binaries.sh"
GO = Path(os.environ.get("CTJ_GO_ROOT", "/usr/local/go")) / "bin" / "go"
_ARCHES = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
if platform.system() != "Linux" or platform.machine() not in _ARCHES:
    pytest.skip(f"no published binaries for {platform.machine()}", allow_module_level=True)
ARCH = _ARCHES[platform.machine()]


def _versions() -> dict[str, str]:
    pairs = {}
    for line in (ROOT / "hack" / "versions.env").read_text().splitlines():
        key, sep, value = line.partition("=")
        if sep and not line.startswith("#"):
            pairs[key.strip()] = value.strip()
    return pairs


V = _versions()
K8S, ETCD, HELM, KIND, CRICTL = (
    V["K8S_VERSION"],
    V["ETCD_VERSION"],
    V["HELM_VERSION"],
    V["KIND_VERSION"],
    V["CRI_TOOLS_VERSION"],
)
# NAME -> (version, the binaries its directory must hold)
TOOLS: dict[str, tuple[str, tuple[str, ...]]] = {
    "k8s": (K8S, ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubectl")),
    "k8s-node": (K8S, ("kubelet", "kubeadm", "kube-proxy", "kubectl")),
    "etcd": (ETCD, ("etcd",)),
    "helm": (HELM, ("helm",)),
    "kind": (KIND, ("kind",)),
    "crictl": (CRICTL, ("crictl",)),
}
SITES = ("dl.k8s.io", "github.com", "get.helm.sh")


# ---- the fake download sites ------------------------------------------------------------
class Site:
    """A static file server on 127.0.0.1 (port chosen by the kernel: no race) that records
    every request as (method, path)."""

    def __init__(self, root: Path) -> None:
        requests: list[tuple[str, str]] = []

        class Handler(SimpleHTTPRequestHandler):
            def __init__(self, *args: object, **kwargs: object) -> None:
                super().__init__(*args, directory=str(root), **kwargs)  # type: ignore[arg-type]

            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                requests.append(("GET", self.path))
                super().do_GET()

            def do_HEAD(self) -> None:  # noqa: N802
                requests.append(("HEAD", self.path))
                super().do_HEAD()

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002
                pass

        self.root = root
        self.requests = requests
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def under(self, prefix: str) -> list[tuple[str, str]]:
        return [r for r in self.requests if r[1].startswith(f"/{prefix}/")]

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    s = Site(tmp_path_factory.mktemp("sites"))
    yield s
    s.stop()


def _exe(name: str, version: str) -> bytes:
    return f"#!/bin/sh\necho '{name} {version}'\n".encode()


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _targz(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path, data in members.items():
            info = tarfile.TarInfo(path)
            info.size, info.mode = len(data), 0o755
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _put(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)


@dataclass
class Mirror:
    """One test's copy of the three sites, under ``site.url/prefix``."""

    site: Site
    prefix: str

    @property
    def url(self) -> str:
        return f"{self.site.url}/{self.prefix}"

    @property
    def dir(self) -> Path:
        return self.site.root / self.prefix

    def requests(self) -> list[tuple[str, str]]:
        return self.site.under(self.prefix)

    def probes(self, site_name: str) -> int:
        return self.requests().count(("HEAD", f"/{self.prefix}/{site_name}/"))


def publish(site: Site) -> Mirror:
    """Lays out every tool's files where upstream publishes them (and its sums' formats)."""
    m = Mirror(site, secrets.token_hex(4))
    k8s = m.dir / "dl.k8s.io" / "release" / K8S / "bin" / "linux" / ARCH
    for b in {*TOOLS["k8s"][1], *TOOLS["k8s-node"][1]}:
        data = _exe(b, K8S)
        _put(k8s / b, data)
        _put(k8s / f"{b}.sha256", _sha(data))  # a bare hash, no newline, as dl.k8s.io
    gh = m.dir / "github.com"
    rel = gh / "etcd-io" / "etcd" / "releases" / "download" / ETCD
    top = f"etcd-{ETCD}-linux-{ARCH}"
    archive = _targz({f"{top}/etcd": _exe("etcd", ETCD), f"{top}/etcdctl": _exe("etcdctl", ETCD),
                      f"{top}/README.md": b"etcd\n"})  # fmt: skip
    other = f"etcd-{ETCD}-darwin-arm64.zip"
    _put(rel / f"{top}.tar.gz", archive)
    _put(rel / "SHA256SUMS", f"{_sha(b'x')}  {other}\n{_sha(archive)}  {top}.tar.gz\n")
    helm_tgz = f"helm-{HELM}-linux-{ARCH}.tar.gz"
    archive = _targz({f"linux-{ARCH}/helm": _exe("helm", HELM), f"linux-{ARCH}/LICENSE": b"-"})
    _put(m.dir / "get.helm.sh" / helm_tgz, archive)
    _put(m.dir / "get.helm.sh" / f"{helm_tgz}.sha256sum", f"{_sha(archive)}  {helm_tgz}\n")
    rel = gh / "kubernetes-sigs" / "kind" / "releases" / "download" / KIND
    data = _exe("kind", KIND)
    _put(rel / f"kind-linux-{ARCH}", data)
    _put(rel / f"kind-linux-{ARCH}.sha256sum", f"{_sha(data)}  kind-linux-{ARCH}\n")
    rel = gh / "kubernetes-sigs" / "cri-tools" / "releases" / "download" / CRICTL
    crictl_tgz = f"crictl-{CRICTL}-linux-{ARCH}.tar.gz"
    archive = _targz({"crictl": _exe("crictl", CRICTL)})
    _put(rel / crictl_tgz, archive)
    _put(rel / f"{crictl_tgz}.sha256", f"{_sha(archive)}\n")
    return m


# ---- running the library and the script -------------------------------------------------
@dataclass
class Run:
    rc: int
    stdout: str
    stderr: str
    seconds: float

    def results(self) -> dict[str, str]:
        """NAME -> "rc=N why=..." lines that DOWNLOAD prints."""
        out = {}
        for line in self.stdout.splitlines():
            name, _, rest = line.partition(" ")
            out[name] = rest
        return out


def _env(**settings: str) -> dict[str, str]:
    """The caller's environment without its download settings, plus ``settings``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CTJ_DOWNLOAD", "CTJ_DL_", "CTJ_PULL", "CTJ_CACHE"))}  # fmt: skip
    env.update(settings)
    return env


def bash(script: str, *args: str, **settings: str) -> Run:
    start = time.monotonic()
    done = subprocess.run(["bash", "-c", script, "bash", *args], cwd=ROOT, env=_env(**settings),
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    return Run(done.returncode, done.stdout, done.stderr, time.monotonic() - start)


# download_tool as hack/cluster-binaries.sh calls it: args are NAME=DIR pairs
DOWNLOAD = """
source hack/versions.env
source hack/registry/download.sh
for pair; do
  name="${pair%%=*}" dir="${pair#*=}"
  case "$name" in
    k8s|k8s-node) v="$K8S_VERSION" ;; etcd) v="$ETCD_VERSION" ;; helm) v="$HELM_VERSION" ;;
    kind) v="$KIND_VERSION" ;; crictl) v="$CRI_TOOLS_VERSION" ;; *) v=v0 ;;
  esac
  rc=0; download_tool "$name" "$v" "$dir" || rc=$?
  echo "$name rc=$rc why=$DL_WHY"
done
"""


def download(cache: Path, *names: str, **settings: str) -> Run:
    return bash(DOWNLOAD, *(f"{n}={cache / f'{n}-dl'}" for n in names), **settings)


def assert_installed(d: Path, name: str) -> None:
    version, binaries = TOOLS[name]
    assert (d / ".complete").is_file(), d
    assert sorted(p.name for p in (d / "bin").iterdir()) == sorted(binaries)
    for b in binaries:
        exe = d / "bin" / b
        assert os.access(exe, os.X_OK), exe
        out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
        assert out.strip() == f"{b} {version}"
    assert not Path(f"{d}.tmp").exists()
    assert not list(d.parent.glob(f"{d.name}.download.*")), "the downloads were not removed"


# ---- (a) download and verify --------------------------------------------------------------
def test_downloads_and_verifies_every_tool(site: Site, tmp_path: Path) -> None:
    m = publish(site)
    run = download(tmp_path, *TOOLS, CTJ_DOWNLOAD_MIRROR=m.url)
    assert run.rc == 0, run.stderr
    assert all(r.startswith("rc=0 ") for r in run.results().values()), run.stdout
    for name in TOOLS:
        d = tmp_path / f"{name}-dl"
        assert_installed(d, name)
        # where each file came from, with the sha256 it was checked against
        assert m.url in (d / ".source").read_text()
    # each site was probed once for the whole process, though several tools share one
    assert [m.probes(s) for s in SITES] == [1, 1, 1], m.requests()
    assert "downloaded and verified" in run.stderr


def test_per_site_base_urls(site: Site, tmp_path: Path) -> None:
    """CTJ_DL_<SITE> points one site at its own proxy (e.g. an Artifactory remote), and wins
    over CTJ_DOWNLOAD_MIRROR."""
    m = publish(site)
    run = download(tmp_path, "k8s", "etcd", "helm",
                   CTJ_DL_K8S=f"{m.url}/dl.k8s.io", CTJ_DL_GITHUB=f"{m.url}/github.com/",
                   CTJ_DL_HELM=f"{m.url}/get.helm.sh",
                   CTJ_DOWNLOAD_MIRROR="http://ctj-no-such-host.invalid")  # fmt: skip
    assert run.rc == 0 and "rc=1" not in run.stdout, run.stdout + run.stderr
    for name in ("k8s", "etcd", "helm"):
        assert_installed(tmp_path / f"{name}-dl", name)


# ---- (b) a checksum that does not match -------------------------------------------------
def test_checksum_mismatch_is_refused(site: Site, tmp_path: Path) -> None:
    m = publish(site)
    k8s = m.dir / "dl.k8s.io" / "release" / K8S / "bin" / "linux" / ARCH
    (k8s / "kubectl").write_bytes(_exe("kubectl", "v6.6.6"))  # sums of the genuine file
    etcd = m.dir / "github.com" / "etcd-io" / "etcd" / "releases" / "download" / ETCD
    (etcd / f"etcd-{ETCD}-linux-{ARCH}.tar.gz").write_bytes(_targz({"evil": b"x"}))
    helm = m.dir / "get.helm.sh" / f"helm-{HELM}-linux-{ARCH}.tar.gz.sha256sum"
    helm.write_text(f"{_sha(b'x')}  some-other-file.tar.gz\n")  # no sum for our file
    kind = m.dir / "github.com" / "kubernetes-sigs" / "kind" / "releases" / "download" / KIND
    (kind / f"kind-linux-{ARCH}.sha256sum").unlink()  # no checksum file at all

    run = download(tmp_path, "k8s", "etcd", "helm", "kind", CTJ_DOWNLOAD_MIRROR=m.url)
    assert run.rc == 0, run.stderr  # auto: each one falls back, the caller builds
    res = run.results()
    assert res["k8s"].startswith("rc=1 why=CHECKSUM MISMATCH for ") and "/kubectl:" in res["k8s"]
    assert res["etcd"].startswith("rc=1 why=CHECKSUM MISMATCH for "), res["etcd"]
    assert res["helm"] == f"rc=1 why=no sha256 for helm-{HELM}-linux-{ARCH}.tar.gz in " \
        f"{m.url}/get.helm.sh/helm-{HELM}-linux-{ARCH}.tar.gz.sha256sum"  # fmt: skip
    assert res["kind"].startswith("rc=1 why=GET ") and "HTTP 404" in res["kind"]
    # loud, and what the build will do instead
    assert f"k8s {K8S}: CHECKSUM MISMATCH" in run.stderr
    assert "refused, nothing installed" in run.stderr
    assert run.stderr.count("building it from source") == 4
    # nothing installed: no directory, no .tmp, no downloads left behind
    assert list(tmp_path.iterdir()) == []

    run = download(tmp_path, "k8s", CTJ_DOWNLOAD_MIRROR=m.url, CTJ_DOWNLOAD="always")
    assert run.rc == 1 and run.stdout == ""
    assert f"always and k8s {K8S} could not be downloaded: CHECKSUM MISMATCH" in run.stderr
    assert list(tmp_path.iterdir()) == []


# ---- (c) no site answers --------------------------------------------------------------------
@pytest.fixture
def closed_port() -> Iterator[int]:
    """A port bound but never listening: connections to it are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield int(s.getsockname()[1])


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) and never answers: a host
    that hangs. (An unroutable address is no good here: this sandbox answers any HTTP.)"""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(16)
        yield int(s.getsockname()[1])


@pytest.mark.parametrize("where", ["closed port", "no such name", "silent host"])
def test_unreachable_site_falls_back_within_seconds(
    where: str, closed_port: int, silent_port: int, tmp_path: Path
) -> None:
    base = {"closed port": f"http://127.0.0.1:{closed_port}",
            "no such name": "https://ctj-no-such-host.invalid",
            "silent host": f"http://127.0.0.1:{silent_port}"}[where]  # fmt: skip
    run = download(tmp_path, "etcd", "kind", "crictl", "k8s",
                   CTJ_DOWNLOAD_MIRROR=base, CTJ_DL_PROBE_TIMEOUT="1")  # fmt: skip
    assert run.rc == 0, run.stderr
    whys = {r.partition(" why=")[2] for r in run.results().values()}
    assert all(r.startswith("rc=1 ") for r in run.results().values()), run.stdout
    # one reason per site, not per tool: github.com was probed once for three tools
    assert len(whys) == 2, whys
    expected = {"closed port": "refused the connection", "no such name": "cannot resolve",
                "silent host": "did not answer within 1s"}[where]  # fmt: skip
    assert all(expected in w for w in whys), whys
    # two probes of at most 1 s each (plus bash and curl starting)
    assert run.seconds < 6, run.seconds
    assert list(tmp_path.iterdir()) == []


# ---- (d) CTJ_DOWNLOAD=never / always ------------------------------------------------------
def test_never_asks_no_site(site: Site, tmp_path: Path) -> None:
    m = publish(site)
    for settings in ({"CTJ_DOWNLOAD": "never"}, {"CTJ_PULL": "never"}):
        run = download(tmp_path, "k8s", "etcd", CTJ_DOWNLOAD_MIRROR=m.url, **settings)
        assert run.rc == 0 and run.results() == {
            "k8s": "rc=1 why=CTJ_DOWNLOAD=never",
            "etcd": "rc=1 why=CTJ_DOWNLOAD=never",
        }, run.stdout + run.stderr
        assert run.stderr == ""  # the build as before, with nothing said
    assert m.requests() == [] and list(tmp_path.iterdir()) == []
    # CTJ_DOWNLOAD wins over CTJ_PULL
    run = download(tmp_path, "etcd", CTJ_DOWNLOAD_MIRROR=m.url, CTJ_PULL="never",
                   CTJ_DOWNLOAD="auto")  # fmt: skip
    assert run.results() == {"etcd": "rc=0 why="}, run.stderr
    assert_installed(tmp_path / "etcd-dl", "etcd")


def test_always_fails_instead_of_building(site: Site, closed_port: int, tmp_path: Path) -> None:
    run = download(tmp_path, "etcd", "helm", CTJ_DOWNLOAD="always",
                   CTJ_DOWNLOAD_MIRROR=f"http://127.0.0.1:{closed_port}")  # fmt: skip
    assert run.rc == 1 and run.stdout == "", run.stdout  # the caller's next step never runs
    assert f"CTJ_DOWNLOAD=always and etcd {ETCD} could not be downloaded: " in run.stderr
    assert "refused the connection" in run.stderr
    assert list(tmp_path.iterdir()) == []
    # nothing to download: always fails too (coredns has no published binary)
    run = download(tmp_path, "coredns", CTJ_DOWNLOAD="always")
    assert run.rc == 1 and "coredns has no published binary" in run.stderr
    # and where the site answers, it downloads
    m = publish(site)
    run = download(tmp_path, "helm", CTJ_DOWNLOAD="always", CTJ_DOWNLOAD_MIRROR=m.url)
    assert run.rc == 0 and run.results() == {"helm": "rc=0 why="}, run.stderr
    assert_installed(tmp_path / "helm-dl", "helm")
    run = download(tmp_path, "helm", CTJ_DOWNLOAD="sometimes")
    assert run.rc == 2 and "CTJ_DOWNLOAD=sometimes is none of auto, never, always" in run.stderr


def test_pick_prefers_any_complete_directory(tmp_path: Path) -> None:
    built, dl = tmp_path / "etcd-v1-0123456789", tmp_path / "etcd-v1-dl"
    pick = 'source hack/registry/download.sh; download_pick "$1" "$2"'

    def picked(**settings: str) -> str:
        run = bash(pick, str(built), str(dl), **settings)
        assert run.rc == 0, run.stderr
        return run.stdout.strip()

    assert picked() == str(built)  # neither: where the build will go
    dl.mkdir()
    assert picked() == str(built)  # an incomplete download does not count
    (dl / ".complete").touch()
    assert picked() == str(dl)
    assert picked(CTJ_DOWNLOAD="always") == str(dl)
    assert picked(CTJ_DOWNLOAD="never") == str(built)  # as on a machine that never downloaded
    built.mkdir()
    (built / ".complete").touch()
    assert picked() == str(built)  # both: the built one, as before this change
    assert picked(CTJ_DOWNLOAD="always") == str(built)  # nothing to compile: kept


# ---- hack/cluster-binaries.sh itself, with a temporary cache --------------------------------
# what has no published binary to download (built from its Go module only)
BUILT_ONLY = ("CTJ_KUBEFLOW_BIN_DIR", "CTJ_KUEUE_BIN_DIR", "CTJ_JOBSET_BIN_DIR",
              "CTJ_KUBEFLOW_TRAINER_BIN_DIR", "CTJ_SEAWEEDFS_BIN_DIR")  # fmt: skip


def _paths(out: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)


@pytest.mark.skipif(not GO.exists() or not shutil.which("flock"), reason="needs Go and flock")
def test_cluster_binaries_downloads_instead_of_building(site: Site, tmp_path: Path) -> None:
    m = publish(site)
    cache = tmp_path / "cache"
    settings = {"CTJ_CACHE": str(cache), "CTJ_DOWNLOAD_MIRROR": m.url, "GOPROXY": "off"}

    def script(*args: str, **more: str) -> Run:
        return bash('exec hack/cluster-binaries.sh "$@"', *args, **{**settings, **more})

    check = script("--check")
    assert check.rc == 3 and check.seconds < 10, check.stderr
    built = _paths(check.stdout)
    kind_built = _paths(script("--kind-check").stdout)
    # what has no published binary (every key but the downloadable three): pretend it is
    # built, so that nothing compiles
    assert set(built) == {"CTJ_ETCD_BIN_DIR", "CTJ_K8S_BIN_DIR", "CTJ_HELM_BIN_DIR", *BUILT_ONLY}
    for key in BUILT_ONLY:
        Path(built[key]).mkdir(parents=True)
        (Path(built[key]).parent / ".complete").touch()
    for key in ("CTJ_KIND_BIN_DIR", "CTJ_COREDNS_BIN_DIR", "CTJ_KIND_TOOLS_BIN_DIR",
                "CTJ_KUBE_NETWORK_POLICIES_BIN_DIR"):  # fmt: skip
        Path(kind_built[key]).mkdir(parents=True)
        (Path(kind_built[key]).parent / ".complete").touch()

    # --local: helm (and SeaweedFS, built here) only, what the tiers before the cluster
    # tier run while the test command builds the rest; every path printed, as --check does
    local = script("--local", CTJ_DOWNLOAD="always")
    assert local.rc == 0, local.stderr
    local_paths = _paths(local.stdout)
    assert list(local_paths) == list(built)
    assert local_paths["CTJ_HELM_BIN_DIR"] == str(cache / f"helm-{TOOLS['helm'][0]}-dl" / "bin")
    assert not any((cache / f"{name}-{TOOLS[name][0]}-dl").exists() for name in ("etcd", "k8s"))
    assert script("--check").rc == 3, "the control plane is still missing"

    # always: a failed download would end the run instead of starting a 50-minute build
    run = script(CTJ_DOWNLOAD="always")
    assert run.rc == 0, run.stderr
    assert "compiling" not in run.stderr
    paths = _paths(run.stdout)
    assert list(paths) == list(built)  # the KEY=PATH contract: same keys, same order
    for key, name, binary in (("CTJ_ETCD_BIN_DIR", "etcd", "etcd"),
                              ("CTJ_K8S_BIN_DIR", "k8s", "kube-apiserver"),
                              ("CTJ_HELM_BIN_DIR", "helm", "helm")):  # fmt: skip
        version = TOOLS[name][0]
        assert paths[key] == str(cache / f"{name}-{version}-dl" / "bin")
        assert_installed(Path(paths[key]).parent, name)
        assert os.access(Path(paths[key]) / binary, os.X_OK)
    for key in BUILT_ONLY:
        assert paths[key] == built[key]

    # warm: nothing asked of any site, by the build mode or by --check
    asked = len(m.requests())
    again = script(CTJ_DOWNLOAD="always")
    assert again.rc == 0 and _paths(again.stdout) == paths and "all binaries cached" in again.stderr
    check = script("--check")
    assert check.rc == 0 and _paths(check.stdout) == paths, check.stderr
    assert len(m.requests()) == asked

    # the kind cluster's: k8s-node and crictl downloaded, etcd and k8s reused
    run = script("--kind", CTJ_DOWNLOAD="always")
    assert run.rc == 0, run.stderr
    kind_paths = _paths(run.stdout)
    assert kind_paths["CTJ_ETCD_BIN_DIR"] == paths["CTJ_ETCD_BIN_DIR"]
    assert kind_paths["CTJ_K8S_BIN_DIR"] == paths["CTJ_K8S_BIN_DIR"]
    for key, name in (("CTJ_K8S_NODE_BIN_DIR", "k8s-node"), ("CTJ_CRICTL_BIN_DIR", "crictl")):
        assert kind_paths[key] == str(cache / f"{name}-{TOOLS[name][0]}-dl" / "bin")
        assert_installed(Path(kind_paths[key]).parent, name)
    assert kind_paths["CTJ_KIND_BIN_DIR"] == kind_built["CTJ_KIND_BIN_DIR"]
    kind_check = script("--kind-check")
    assert kind_check.rc == 0 and _paths(kind_check.stdout) == kind_paths

    # never: the downloaded directories do not count (the built paths, exit 3: not built)
    never = script("--check", CTJ_DOWNLOAD="never")
    assert never.rc == 3 and _paths(never.stdout) == built
