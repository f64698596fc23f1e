"""Kubeconfig files for the cluster's users.

Every component (admin, controller-manager, scheduler, each node agent) gets its own
kubeconfig pointing at its own client certificate, so the API server sees the same
identities it would in a real cluster. The files are JSON, which is YAML too: kubectl,
helm and the ``kubernetes`` Python client all read them, and we need no YAML writer.
"""

from __future__ import annotations

import json
from pathlib import Path

from .certs import CertPair


def write_kubeconfig(
    path: Path,
    *,
    server: str,
    ca_cert: Path,
    client: CertPair,
    user: str,
    cluster_name: str = "ctj-dev",
    namespace: str = "default",
) -> Path:
    """Writes a one-context kubeconfig for ``user`` (a label; the identity is the cert)."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": cluster_name,
                "cluster": {"server": server, "certificate-authority": str(ca_cert)},
            }
        ],
        "users": [
            {
                "name": user,
                "user": {"client-certificate": str(client.cert), "client-key": str(client.key)},
            }
        ],
        "contexts": [
            {
                "name": f"{user}@{cluster_name}",
                "context": {"cluster": cluster_name, "user": user, "namespace": namespace},
            }
        ],
        "current-context": f"{user}@{cluster_name}",
        "preferences": {},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    path.chmod(0o600)
    return path
