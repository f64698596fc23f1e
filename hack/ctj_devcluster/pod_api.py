"""What a kubelet does to pods through its node's credentials, in one place.

Every call here is one the Node authorizer allows a node only for pods bound to it: read
the Secrets and ConfigMaps they reference, request their service-account tokens, write
their status and Events, and remove them once their containers are gone. Keeping the calls
together makes the node's API surface easy to review against a kubelet's.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from .podspec import Obj

log = logging.getLogger("ctj_devcluster.node_agent")


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


class PodApi:
    def __init__(self, api: client.ApiClient, node_name: str) -> None:
        self.api = api
        self.core = client.CoreV1Api(api)
        self.node_name = node_name

    def delete_pod(self, pod: Obj) -> None:
        meta = pod["metadata"]
        try:
            self.core.delete_namespaced_pod(
                meta["name"],
                meta["namespace"],
                grace_period_seconds=0,
                body={"preconditions": {"uid": meta["uid"]}, "gracePeriodSeconds": 0},
            )
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("delete pod %s/%s: %s", meta["namespace"], meta["name"], exc.reason)

    def patch_pod_status(self, pod: Obj, status: dict[str, Any]) -> bool:
        meta = pod["metadata"]
        try:
            # A strategic merge patch, as the kubelet sends: conditions merge by type and
            # container statuses by name. (call_api: older clients cannot set the type.)
            self.api.call_api(
                "/api/v1/namespaces/{namespace}/pods/{name}/status",
                "PATCH",
                path_params={"namespace": meta["namespace"], "name": meta["name"]},
                header_params={
                    "Content-Type": "application/strategic-merge-patch+json",
                    "Accept": "application/json",
                },
                body={"metadata": {"uid": meta["uid"]}, "status": status},
                auth_settings=["BearerToken"],
                response_type="object",
                _return_http_data_only=True,
                _preload_content=False,
            )
            return True
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.warning(
                    "status of %s/%s: %s %s", meta["namespace"], meta["name"], exc.status, exc.body
                )
            return False

    def record_event(self, pod: Obj, kind: str, reason: str, message: str) -> None:
        """A core/v1 Event about a pod from this node's "kubelet", as `kubectl describe`
        shows them. Best effort: an event that cannot be written is only logged."""
        meta = pod["metadata"]
        t = now_rfc3339()
        try:
            self.core.create_namespaced_event(
                meta["namespace"],
                {
                    "metadata": {
                        "generateName": f"{meta['name']}.",
                        "namespace": meta["namespace"],
                    },
                    "involvedObject": {
                        "kind": "Pod",
                        "apiVersion": "v1",
                        "name": meta["name"],
                        "namespace": meta["namespace"],
                        "uid": meta["uid"],
                    },
                    "type": kind,
                    "reason": reason,
                    "message": message,
                    "count": 1,
                    "firstTimestamp": t,
                    "lastTimestamp": t,
                    "source": {"component": "kubelet", "host": self.node_name},
                    "reportingComponent": "kubelet",
                    "reportingInstance": self.node_name,
                },
            )
        except Exception as exc:
            log.info(
                "event %s for %s/%s not recorded: %r", reason, meta["namespace"], meta["name"], exc
            )

    # --- what workers read through the node's credentials --------------------------------
    def _read(self, fn: Any, namespace: str, name: str) -> Obj | None:
        try:
            obj: Obj = json.loads(fn(name, namespace, _preload_content=False).data)
            return obj
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def get_secret(self, namespace: str, name: str) -> Obj | None:
        return self._read(self.core.read_namespaced_secret, namespace, name)

    def get_config_map(self, namespace: str, name: str) -> Obj | None:
        return self._read(self.core.read_namespaced_config_map, namespace, name)

    def request_token(self, namespace: str, service_account: str, spec: Obj) -> str:
        result = self.core.create_namespaced_service_account_token(
            service_account, namespace, {"spec": dict(spec)}
        )
        return str(result.status.token)
