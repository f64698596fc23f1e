"""Pull-or-build (hack/registry/pull.sh) against a real registry on loopback.

This machine reaches no registry, so the CNCF distribution registry (built from the Go
module proxy by hack/registry/registry.sh, cached) stands in for registry.k8s.io or a
corporate mirror. Each test builds a tiny image of its own under a standard-looking name
(``registry.k8s.io/pause:ctj-test-<random>``: no real image is touched), and runs the
library exactly as hack/kind/images.sh does: ``pull_image NAME || build NAME``. Every
image a test makes is removed when it ends; the registry's storage is a temporary
directory. Needs Docker only (no cluster): skips where no daemon answers.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.conftest import free_port

ROOT = Path(__file__).resolve().parents[2]
DOCKER = "/usr/bin/docker"  # Debian's CLI, as the image scripts use
REGISTRY_SCRIPT = ROOT / "hack" / "registry" / "registry.sh"

# What hack/kind/images.sh does for a published image: pull it, else build it here.
PULL_OR_BUILD = """
source hack/registry/pull.sh
pull_image "$1" && exit 0
echo "building $1 (not pulled: $PULL_WHY)" >&2
"$DOCKER" build -q -t "$1" "$2" >/dev/null
"""


@dataclass
class Run:
    rc: int
    stderr: str
    seconds: float


def _env(**settings: str) -> dict[str, str]:
    """The caller's environment without its pull settings, plus ``settings``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("CTJ_PULL", "CTJ_REGISTRY_MIRROR"))}  # fmt: skip
    env.update(DOCKER=DOCKER, DOCKER_BUILDKIT="1", **settings)
    return env


def bash(script: str, *args: str, **settings: str) -> Run:
    start = time.monotonic()
    done = subprocess.run(["bash", "-c", script, "bash", *args], cwd=ROOT, env=_env(**settings),
                          capture_output=True, text=True, timeout=180)  # fmt: skip
    return Run(done.returncode, done.stderr, time.monotonic() - start)


def docker(*args: str, check: bool = True) -> str:
    done = subprocess.run([DOCKER, *args], capture_output=True, text=True, timeout=120)
    if check and done.returncode != 0:
        raise AssertionError(f"docker {' '.join(args)}: {done.stderr.strip()}")
    return done.stdout.strip()


def image_id(name: str) -> str | None:
    out = subprocess.run([DOCKER, "image", "inspect", "-f", "{{.Id}}", name],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    return out.stdout.strip() if out.returncode == 0 else None


@dataclass
class Images:
    """Tiny images made under test names; all of them are removed at the end, with any
    that a later build or pull left without a name (their IDs are recorded)."""

    workdir: Path
    names: list[str] = field(default_factory=list)
    ids: set[str] = field(default_factory=set)

    def name(self) -> str:
        name = f"registry.k8s.io/pause:ctj-test-{secrets.token_hex(4)}"
        self.names.append(name)
        return name

    def context(self, ours: bool = True) -> Path:
        """A build context whose image is new each time (a random file). ``ours``: with
        the label hack/kind/images.sh puts on what it builds (a published image has none)."""
        ctx = self.workdir / secrets.token_hex(4)
        ctx.mkdir()
        (ctx / "content").write_text(secrets.token_hex(16))
        label = "LABEL ctj.inputs=test\n" if ours else ""
        (ctx / "Dockerfile").write_text(f"FROM scratch\nCOPY content /content\n{label}")
        return ctx

    def publish(self, name: str) -> str:
        """Build NAME as a registry would serve it (no ctj.inputs label); its ID."""
        docker("build", "-q", "-t", name, str(self.context(ours=False)))
        got = image_id(name)
        assert got
        self.ids.add(got)
        return got

    def remove_all(self) -> None:
        self.ids.update(i for i in map(image_id, self.names) if i)
        present = [i for i in self.ids if image_id(i)]
        if present:
            docker("rmi", "-f", *present, check=False)


@pytest.fixture(scope="module")
def docker_daemon() -> None:
    reason = os.environ.get("CTJ_E2E_SKIP_REASON")
    if reason:
        pytest.skip(f"e2e tier: {reason}")
    check = subprocess.run([str(ROOT / "hack" / "containers" / "docker.sh"), "--check"],
                           capture_output=True, timeout=30)  # fmt: skip
    if check.returncode != 0:
        pytest.skip("no Docker daemon answers (hack/containers/docker.sh starts one)")


@pytest.fixture(scope="module")
def registry(docker_daemon: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The distribution registry on 127.0.0.1 (Docker pulls from loopback over plain
    HTTP without configuration); yields its HOST:PORT."""
    # a cold build takes a few minutes (cached afterwards under CTJ_CACHE)
    subprocess.run([str(REGISTRY_SCRIPT), "build"], check=True, capture_output=True, timeout=900)
    port = free_port()
    root = tmp_path_factory.mktemp("registry")
    log = (root / "registry.log").open("w")
    proc = subprocess.Popen([str(REGISTRY_SCRIPT), "run", str(port), str(root / "store")],
                            stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not _answers(f"http://127.0.0.1:{port}/v2/"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the registry did not start: {_tail(root / 'registry.log')}")
            try:
                proc.wait(timeout=0.2)  # returns early only if it exits
            except subprocess.TimeoutExpired:
                pass
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def _tail(path: Path) -> str:
    return " | ".join(path.read_text().splitlines()[-5:])


@pytest.fixture
def images(docker_daemon: None, tmp_path: Path) -> Iterator[Images]:
    made = Images(tmp_path)
    yield made
    made.remove_all()


def push(images: Images, mirror: str, name: str) -> str:
    """Build NAME, push it to the mirror as MIRROR/NAME, and leave neither tag in Docker:
    the next pull has to come from the registry. Returns the image's ID."""
    built = images.publish(name)
    images.names.append(f"{mirror}/{name}")
    docker("tag", name, f"{mirror}/{name}")
    docker("push", "-q", f"{mirror}/{name}")
    docker("rmi", name, f"{mirror}/{name}")
    assert image_id(name) is None
    return built


def test_with_the_mirror_the_image_is_pulled_not_built(registry: str, images: Images) -> None:
    name = images.name()
    pushed = push(images, registry, name)

    run = bash(PULL_OR_BUILD, name, str(images.context()), CTJ_REGISTRY_MIRROR=registry)

    assert run.rc == 0, run.stderr
    assert f"pulled from {registry}/{name}" in run.stderr
    assert "building" not in run.stderr
    assert image_id(name) == pushed  # the same content under the standard name
    assert image_id(f"{registry}/{name}") is None  # the mirror's name is dropped
    # a later run keeps it without asking any registry (this one does not answer)
    again = bash(PULL_OR_BUILD, name, str(images.context()),
                 CTJ_REGISTRY_MIRROR=f"127.0.0.1:{free_port()}")  # fmt: skip
    assert (again.rc, again.stderr) == (0, "")
    assert image_id(name) == pushed


def test_an_image_the_registry_lacks_is_built(registry: str, images: Images) -> None:
    name = images.name()

    run = bash(PULL_OR_BUILD, name, str(images.context()), CTJ_REGISTRY_MIRROR=registry)

    assert run.rc == 0, run.stderr
    assert f"building {name} (not pulled: docker pull {registry}/{name}:" in run.stderr
    assert "not found" in run.stderr
    assert image_id(name)


def test_pull_never_builds_even_where_the_registry_has_it(registry: str, images: Images) -> None:
    name = images.name()
    pushed = push(images, registry, name)

    run = bash(PULL_OR_BUILD, name, str(images.context()),
               CTJ_REGISTRY_MIRROR=registry, CTJ_PULL="never")  # fmt: skip

    assert run.rc == 0, run.stderr
    assert "not pulled: CTJ_PULL=never" in run.stderr
    assert image_id(name) not in (None, pushed)


@pytest.mark.parametrize(
    ("mirror", "why"),
    [
        ("127.0.0.1:{closed}", "refused the connection"),  # nothing listens
        ("192.0.2.1:5000", ""),  # TEST-NET-1: no answer (or no route), within the timeout
        ("ctj-no-such-registry.invalid", "cannot resolve"),  # no DNS
    ],
)
def test_with_no_registry_the_probe_answers_in_seconds_and_it_builds(
    images: Images, mirror: str, why: str
) -> None:
    name = images.name()
    mirror = mirror.format(closed=free_port())

    probe = bash('source hack/registry/pull.sh; pull_image "$1" || echo "$PULL_WHY" >&2', name,
                 CTJ_REGISTRY_MIRROR=mirror, CTJ_PULL_PROBE_TIMEOUT="2")  # fmt: skip
    assert probe.rc == 0, probe.stderr
    assert why in probe.stderr
    assert probe.seconds < 2 * 2 + 3  # two tries (https, http) of at most 2 s each

    run = bash(PULL_OR_BUILD, name, str(images.context()),
               CTJ_REGISTRY_MIRROR=mirror, CTJ_PULL_PROBE_TIMEOUT="2")  # fmt: skip
    assert run.rc == 0, run.stderr
    assert f"building {name} (not pulled: " in run.stderr
    assert image_id(name)


def test_pull_always_fails_clearly_when_it_cannot_pull(images: Images) -> None:
    name = images.name()
    mirror = f"127.0.0.1:{free_port()}"

    run = bash(PULL_OR_BUILD, name, str(images.context()),
               CTJ_REGISTRY_MIRROR=mirror, CTJ_PULL="always")  # fmt: skip

    assert run.rc == 1
    assert f"CTJ_PULL=always and {name} could not be pulled: {mirror} refused" in run.stderr
    assert "building" not in run.stderr
    assert image_id(name) is None


@pytest.mark.parametrize(
    ("mirror", "name", "source"),
    [
        ("", "registry.k8s.io/pause:3.10", "registry.k8s.io/pause:3.10"),
        ("m.corp:5000", "registry.k8s.io/pause:3.10", "m.corp:5000/registry.k8s.io/pause:3.10"),
        ("m.corp/cache/", "docker.io/kubeflow/x:v1", "m.corp/cache/docker.io/kubeflow/x:v1"),
        (
            "registry.k8s.io=m.corp/k8s docker.io=m.corp/hub",
            "registry.k8s.io/etcd:3.6.16-0",
            "m.corp/k8s/etcd:3.6.16-0",
        ),
        (
            "registry.k8s.io=m.corp/k8s docker.io=m.corp/hub",
            "docker.io/kubeflow/x:v1",
            "m.corp/hub/kubeflow/x:v1",
        ),
        ("docker.io=m.corp/hub", "registry.k8s.io/pause:3.10", "registry.k8s.io/pause:3.10"),
    ],
)
def test_the_mirror_setting_maps_names(mirror: str, name: str, source: str) -> None:
    run = subprocess.run(["bash", "-c", 'source hack/registry/pull.sh; pull_source "$1"', "bash",
                          name], cwd=ROOT, env=_env(CTJ_REGISTRY_MIRROR=mirror),
                         capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    assert run.stdout.strip() == source
