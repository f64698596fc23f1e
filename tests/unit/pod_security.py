"""The `restricted` Pod Security Standard as a pure check of a pod spec, for unit tests.

Kubernetes' own admission (the e2e tier's namespace enforces `restricted`) is the judge;
this is the same rule list (https://kubernetes.io/docs/concepts/security/pod-security-standards/,
the `latest` version: baseline's controls plus restricted's), written once so that every
pod ctj builds and every pod its chart renders is checked without a cluster, and so that
a failure names the container and the field to fix. ``violations`` also takes a set of
container names, to judge only the containers ctj adds to a user's pod.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Mapping
from typing import Any

RESTRICTED_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)
SAFE_SYSCTLS = frozenset(
    {
        "kernel.shm_rmid_forced",
        "net.ipv4.ip_local_port_range",
        "net.ipv4.ip_unprivileged_port_start",
        "net.ipv4.tcp_syncookies",
        "net.ipv4.ping_group_range",
        "net.ipv4.ip_local_reserved_ports",
        "net.ipv4.tcp_keepalive_time",
        "net.ipv4.tcp_fin_timeout",
        "net.ipv4.tcp_keepalive_intvl",
        "net.ipv4.tcp_keepalive_probes",
    }
)
SECCOMP_ALLOWED = frozenset({"RuntimeDefault", "Localhost"})
CAPABILITIES_ADD_ALLOWED = frozenset({"NET_BIND_SERVICE"})
CONTAINER_LISTS = ("initContainers", "containers", "ephemeralContainers")


def containers(pod_spec: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
    for key in CONTAINER_LISTS:
        yield from pod_spec.get(key) or []


def _pod_violations(spec: Mapping[str, Any]) -> Iterator[str]:
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            yield f"pod: spec.{field} is true"
    for volume in spec.get("volumes") or []:
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            yield f"pod: volume {volume['name']} is {'/'.join(sorted(kinds))}"
    sc = spec.get("securityContext") or {}
    if sc.get("runAsUser") == 0:
        yield "pod: securityContext.runAsUser is 0"
    seccomp = (sc.get("seccompProfile") or {}).get("type")
    if seccomp is not None and seccomp not in SECCOMP_ALLOWED:
        yield f"pod: securityContext.seccompProfile.type is {seccomp}"
    for sysctl in sc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            yield f"pod: securityContext.sysctls has {sysctl.get('name')}"
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        yield "pod: windowsOptions.hostProcess is true"


def _container_violations(c: Mapping[str, Any], pod_sc: Mapping[str, Any]) -> Iterator[str]:
    name, sc = c.get("name", "?"), c.get("securityContext") or {}
    where = f"container {name}: securityContext"
    if sc.get("privileged"):
        yield f"{where}.privileged is true"
    if sc.get("allowPrivilegeEscalation") is not False:
        yield f"{where}.allowPrivilegeEscalation must be false"
    non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
    if non_root is not True:
        yield f"{where}.runAsNonRoot must be true (here or in the pod's)"
    if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
        yield f"{where}.runAsUser is 0"
    seccomp = (sc.get("seccompProfile") or pod_sc.get("seccompProfile") or {}).get("type")
    if seccomp not in SECCOMP_ALLOWED:
        yield (
            f"{where}.seccompProfile.type must be RuntimeDefault or Localhost (here or in "
            f"the pod's), is {seccomp}"
        )
    caps = sc.get("capabilities") or {}
    if "ALL" not in (caps.get("drop") or []):
        yield f"{where}.capabilities.drop must include ALL"
    added = set(caps.get("add") or []) - CAPABILITIES_ADD_ALLOWED
    if added:
        yield f"{where}.capabilities.add has {sorted(added)}"
    if sc.get("procMount") not in (None, "Default"):
        yield f"{where}.procMount is {sc['procMount']}"
    if (sc.get("windowsOptions") or {}).get("hostProcess"):
        yield f"{where}.windowsOptions.hostProcess is true"
    for port in c.get("ports") or []:
        if port.get("hostPort"):
            port_name = port.get("name") or port["containerPort"]
            yield f"container {name}: port {port_name} has a hostPort"


def violations(pod_spec: Mapping[str, Any], only: Collection[str] | None = None) -> list[str]:
    """Every way ``pod_spec`` fails `restricted`, as "<where>: <what>" lines ([] = it
    passes). ``only``: judge only these containers (and the pod-level fields), e.g. those
    ctj adds to a user's template."""
    pod_sc = pod_spec.get("securityContext") or {}
    found = list(_pod_violations(pod_spec))
    for c in containers(pod_spec):
        if only is None or c.get("name") in only:
            found.extend(_container_violations(c, pod_sc))
    return found


def writable_root(pod_spec: Mapping[str, Any], only: Collection[str] | None = None) -> list[str]:
    """The containers (of ``only``) whose root filesystem is writable: not part of
    `restricted`, but where ctj can run read-only it does."""
    return [
        c.get("name", "?")
        for c in containers(pod_spec)
        if (only is None or c.get("name") in only)
        and (c.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True
    ]
