"""A pod's volumes as host directories, ready to be bind-mounted into its containers.

Supported: emptyDir (``medium: Memory`` lives under /dev/shm, as the tmpfs a kubelet would
mount), secret, configMap, downwardAPI, projected (serviceAccountToken, secret, configMap,
downwardAPI: what the ServiceAccount admission plugin adds as ``kube-api-access-*``) and
hostPath, which is the node's own: ``<node root>/host/<path>``, so two nodes on one machine
never share one (a node-local cache must be lost with its node). The service-account token
comes from the TokenRequest API, bound to the pod, with the node's own credentials: the
Node authorizer allows that only for pods on this node.
Anything else is a ConfigError, reported on the pod like a kubelet would.
"""

from __future__ import annotations

import base64
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from .podspec import ConfigError, Getter, Obj, field_ref

TokenFn = Callable[[str, str, Obj], str]
"""(namespace, service account, TokenRequest spec) -> token."""


def _write(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    path.chmod(mode)


def _write_keys(
    directory: Path, obj: Obj | None, ref: Obj, *, secret: bool, default_mode: int, what: str
) -> None:
    if obj is None:
        if ref.get("optional"):
            return
        raise ConfigError(f"{what} {ref.get('name') or ref.get('secretName')!r} not found")
    data = dict(obj.get("data") or {})
    items = ref.get("items")
    wanted = (
        [(i["key"], i["path"], i.get("mode", default_mode)) for i in items]
        if items
        else [(k, k, default_mode) for k in data]
    )
    for key, rel, mode in wanted:
        if key not in data:
            if ref.get("optional"):
                continue
            raise ConfigError(f"{what}: key {key!r} not found")
        raw = base64.b64decode(data[key]) if secret else str(data[key]).encode()
        _write(directory / rel, raw, mode)


def _downward(directory: Path, pod: Obj, items: list[Obj], default_mode: int) -> None:
    for item in items:
        if "fieldRef" not in item:
            raise ConfigError("downwardAPI volume: only fieldRef items are supported")
        value = field_ref(pod, item["fieldRef"]["fieldPath"])
        _write(directory / item["path"], value.encode(), item.get("mode", default_mode))


def materialize(
    pod: Obj,
    pod_dir: Path,
    *,
    get_secret: Getter,
    get_config_map: Getter,
    request_token: TokenFn,
    shm_dir: Path,
    host_root: Path,
) -> dict[str, Path]:
    """Creates every volume of ``pod`` and returns volume name -> host path
    (``medium: Memory`` emptyDirs under ``shm_dir``, the pod's tmpfs)."""
    meta, spec = pod["metadata"], pod["spec"]
    namespace = meta["namespace"]
    paths: dict[str, Path] = {}
    for volume in spec.get("volumes") or []:
        name = volume["name"]
        target = pod_dir / "volumes" / name
        if "emptyDir" in volume:
            if (volume["emptyDir"] or {}).get("medium") == "Memory":
                target = shm_dir / name
            target.mkdir(parents=True, exist_ok=True)
        elif "hostPath" in volume:
            target = host_root / volume["hostPath"]["path"].lstrip("/")
            if volume["hostPath"].get("type") in ("DirectoryOrCreate",):
                target.mkdir(parents=True, exist_ok=True)
        elif "secret" in volume:
            ref = volume["secret"]
            target.mkdir(parents=True, exist_ok=True)
            _write_keys(
                target,
                get_secret(namespace, ref["secretName"]),
                ref,
                secret=True,
                default_mode=ref.get("defaultMode", 0o644),
                what="secret",
            )
        elif "configMap" in volume:
            ref = volume["configMap"]
            target.mkdir(parents=True, exist_ok=True)
            _write_keys(
                target,
                get_config_map(namespace, ref["name"]),
                ref,
                secret=False,
                default_mode=ref.get("defaultMode", 0o644),
                what="configMap",
            )
        elif "downwardAPI" in volume:
            ref = volume["downwardAPI"]
            target.mkdir(parents=True, exist_ok=True)
            _downward(target, pod, ref.get("items") or [], ref.get("defaultMode", 0o644))
        elif "projected" in volume:
            target.mkdir(parents=True, exist_ok=True)
            _projected(
                target,
                pod,
                volume["projected"],
                get_secret=get_secret,
                get_config_map=get_config_map,
                request_token=request_token,
            )
        else:
            kinds = sorted(set(volume) - {"name"})
            raise ConfigError(f"volume {name!r}: unsupported volume type {kinds}")
        paths[name] = target
    return paths


def _projected(
    target: Path,
    pod: Obj,
    projected: Obj,
    *,
    get_secret: Getter,
    get_config_map: Getter,
    request_token: TokenFn,
) -> None:
    meta, spec = pod["metadata"], pod["spec"]
    mode = projected.get("defaultMode", 0o644)
    for source in projected.get("sources") or []:
        if "serviceAccountToken" in source:
            sat = source["serviceAccountToken"]
            request: dict[str, Any] = {
                "expirationSeconds": sat.get("expirationSeconds", 3600),
                "boundObjectRef": {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "name": meta["name"],
                    "uid": meta["uid"],
                },
            }
            if sat.get("audience"):
                request["audiences"] = [sat["audience"]]
            token = request_token(
                meta["namespace"], spec.get("serviceAccountName") or "default", request
            )
            _write(target / sat["path"], token.encode(), mode)
        elif "secret" in source:
            ref = source["secret"]
            _write_keys(
                target,
                get_secret(meta["namespace"], ref["name"]),
                ref,
                secret=True,
                default_mode=mode,
                what="secret",
            )
        elif "configMap" in source:
            ref = source["configMap"]
            _write_keys(
                target,
                get_config_map(meta["namespace"], ref["name"]),
                ref,
                secret=False,
                default_mode=mode,
                what="configMap",
            )
        elif "downwardAPI" in source:
            _downward(target, pod, source["downwardAPI"].get("items") or [], mode)
        else:
            raise ConfigError(f"projected volume: unsupported source {sorted(source)}")


def container_mounts(container: Obj, volume_paths: Mapping[str, Path]) -> list[dict[str, Any]]:
    """pod_exec's mount list for one container's volumeMounts (subPath supported)."""
    mounts = []
    for vm in container.get("volumeMounts") or []:
        if vm["name"] not in volume_paths:
            raise ConfigError(f"volumeMount {vm['name']!r}: no such volume")
        source = volume_paths[vm["name"]]
        if vm.get("subPath"):
            source = source / vm["subPath"]
            if not source.exists():
                source.mkdir(parents=True)
        mounts.append(
            {
                "source": str(source),
                "target": vm["mountPath"],
                "read_only": bool(vm.get("readOnly")),
            }
        )
    return mounts


def cleanup(pod_dir: Path, shm_dir: Path) -> None:
    """Removes a finished pod's volumes (the memory-backed ones live in ``shm_dir``)."""
    shutil.rmtree(shm_dir, ignore_errors=True)
    shutil.rmtree(pod_dir / "volumes", ignore_errors=True)
