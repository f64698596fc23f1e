"""What a kubelet computes from a pod spec before it starts a container, as pure functions.

Environment (``value``, downward-API ``fieldRef``/``resourceFieldRef``, ``secretKeyRef``,
``configMapKeyRef``, ``envFrom``), ``$(VAR)`` expansion in env, command and args, the
restart decision and the pod phase. Kept free of I/O: the node agent passes in getters for
Secrets and ConfigMaps, so these rules are tested without a cluster.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Obj = Mapping[str, Any]
Getter = Callable[[str, str], Obj | None]
"""(namespace, name) -> the object as a dict, or None if it does not exist."""

_VAR_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


class ConfigError(ValueError):
    """The container cannot start: the kubelet's CreateContainerConfigError."""


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined names are replaced, $$ escapes a dollar,
    undefined references are left as they are."""

    def sub(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name = match.group(1)
        return env[name] if name in env else match.group(0)

    return _VAR_REF.sub(sub, text)


def field_ref(pod: Obj, path: str) -> str:
    """The downward API's fieldRef.fieldPath values."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
    simple: dict[str, Any] = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.hostIP": status.get("hostIP"),
        "status.podIP": status.get("podIP"),
        "status.hostIPs": ",".join(i["ip"] for i in status.get("hostIPs") or []),
        "status.podIPs": ",".join(i["ip"] for i in status.get("podIPs") or []),
    }
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1]) or {}
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    if path not in simple:
        raise ConfigError(f"unsupported fieldRef fieldPath {path!r}")
    return "" if simple[path] is None else str(simple[path])


def _quantity(value: str) -> float:
    suffixes = {
        "m": 1e-3,
        "k": 1e3,
        "M": 1e6,
        "G": 1e9,
        "T": 1e12,
        "Ki": 2**10,
        "Mi": 2**20,
        "Gi": 2**30,
        "Ti": 2**40,
    }
    m = re.fullmatch(r"([0-9.]+)([a-zA-Z]*)", str(value))
    if not m or (m.group(2) and m.group(2) not in suffixes):
        raise ConfigError(f"unsupported quantity {value!r}")
    return float(m.group(1)) * suffixes.get(m.group(2), 1.0)


def resource_field_ref(container: Obj, ref: Obj, node_allocatable: Mapping[str, str]) -> str:
    """limits.cpu / requests.memory etc.; a missing limit falls back to the node's
    allocatable, as in a real cluster. Rounded up in units of ``divisor``."""
    kind, _, resource = ref["resource"].partition(".")
    section = (container.get("resources") or {}).get(kind) or {}
    raw = section.get(resource) or node_allocatable.get(resource, "0")
    divisor = _quantity(ref.get("divisor") or "1")
    value = _quantity(raw) / divisor
    return str(int(value) if value == int(value) else int(value) + 1)


def _key_ref(kind: str, getter: Getter, namespace: str, ref: Obj) -> str | None:
    obj = getter(namespace, ref["name"])
    optional = bool(ref.get("optional"))
    if obj is None:
        if optional:
            return None
        raise ConfigError(f'{kind} "{ref["name"]}" not found')
    key = ref["key"]
    if kind == "secret":
        data = obj.get("data") or {}
        if key in data:
            return base64.b64decode(data[key]).decode()
    else:
        if key in (obj.get("data") or {}):
            return str(obj["data"][key])
    if optional:
        return None
    raise ConfigError(f"couldn't find key {key} in {kind} {namespace}/{ref['name']}")


def container_env(
    pod: Obj,
    container: Obj,
    *,
    base: Mapping[str, str],
    get_secret: Getter,
    get_config_map: Getter,
    node_allocatable: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The container's environment: ``base`` (PATH, KUBERNETES_SERVICE_*, HOSTNAME), then
    envFrom, then env in order, each value expanded against what came before."""
    namespace = pod["metadata"]["namespace"]
    env = dict(base)
    for source in container.get("envFrom") or []:
        prefix = source.get("prefix", "")
        for kind, getter in (("secret", get_secret), ("configMap", get_config_map)):
            ref = source.get(f"{kind}Ref")
            if not ref:
                continue
            obj = getter(namespace, ref["name"])
            if obj is None:
                if ref.get("optional"):
                    continue
                raise ConfigError(f'{kind} "{ref["name"]}" not found')
            for key, raw in (obj.get("data") or {}).items():
                env[prefix + key] = base64.b64decode(raw).decode() if kind == "secret" else str(raw)
    for var in container.get("env") or []:
        name = var["name"]
        if "valueFrom" not in var:
            env[name] = expand(str(var.get("value", "")), env)
            continue
        source = var["valueFrom"]
        value: str | None
        if "fieldRef" in source:
            value = field_ref(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            value = resource_field_ref(
                container, source["resourceFieldRef"], node_allocatable or {}
            )
        elif "secretKeyRef" in source:
            value = _key_ref("secret", get_secret, namespace, source["secretKeyRef"])
        elif "configMapKeyRef" in source:
            value = _key_ref("configMap", get_config_map, namespace, source["configMapKeyRef"])
        else:
            raise ConfigError(f"env {name}: unsupported valueFrom {sorted(source)}")
        if value is not None:
            env[name] = value
    return env


def image_repository(image: str) -> str:
    """``registry:5000/ns/name:tag@sha256:...`` -> ``registry:5000/ns/name``."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)
    if ":" in last[-1]:
        name = name[: name.rfind(":")]
    return name


def container_argv(
    container: Obj,
    env: Mapping[str, str],
    entrypoints: Mapping[str, Sequence[str]] | None = None,
) -> list[str]:
    """command + args with $(VAR) expanded. There is no image to run, so a container must
    name its command (``python`` resolves to the node's venv), or its image's repository
    must be in ``entrypoints`` (the stand-in for the image's ENTRYPOINT, e.g.
    ``{"ghcr.io/ctj/operator": ["python", "-m", "ctj_operator"]}``)."""
    command: Sequence[str] = container.get("command") or []
    args: Sequence[str] = container.get("args") or []
    if not command:
        command = (entrypoints or {}).get(image_repository(container.get("image") or ""), [])
    if not command:
        raise ConfigError(
            f"container {container['name']!r} has no command and its image "
            f"{container.get('image')!r} has no local entrypoint: the local node runs "
            "commands as host processes"
        )
    return [expand(str(a), env) for a in [*command, *args]]


def should_restart(restart_policy: str, exit_code: int) -> bool:
    """Whether a container that exited is started again (the pod's restartPolicy)."""
    if restart_policy == "Always":
        return True
    if restart_policy == "OnFailure":
        return exit_code != 0
    return False


def pod_phase(restart_policy: str, exit_codes: Mapping[str, int | None]) -> str:
    """The phase from each regular container's last exit code (None: still running or
    going to run again). Running until every container is done for good; then Succeeded
    if all exited 0, else Failed."""
    if any(code is None for code in exit_codes.values()):
        return "Running"
    if restart_policy == "Always":
        return "Running"
    return "Succeeded" if all(code == 0 for code in exit_codes.values()) else "Failed"
