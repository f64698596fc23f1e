"""Regenerate the Kubernetes types embedded in the CheckpointedTrainingJob CRD.

``spec.template`` is a PodTemplateSpec and ``spec.checkpoint.sidecarResources`` a
ResourceRequirements: the CRD carries their schema, so the API server validates a job's
pod template at apply (a wrong field type, an unknown quantity, a missing container
name are a 422, not a crash loop) and ``kubectl explain ctj.spec.template`` explains it.
The schema is not written by hand: this script reads the API server's own OpenAPI v3
(``/openapi/v3/api/v1``) and rewrites, in crds/ and charts/ctj/crds/, every block
between

    # BEGIN generated: <definition> ...
    # END generated

with that definition's ``properties`` as a structural CRD schema: references inlined,
IntOrString and Quantity as ``x-kubernetes-int-or-string``, Time as ``date-time``, the
list and map types kept (server-side apply merges containers by name, as in a Pod),
ObjectMeta cut to what a template may carry (labels, annotations, name, namespace,
finalizers), defaults dropped (they would be written into every job) except those of
list-map keys (the API server requires them), ephemeral containers left out, and each
description cut to its first sentence. Measured from Kubernetes 1.34: the template's
schema is 131 KiB as compact JSON, the whole CRD 148 KiB; with whole descriptions the
template alone would be 270 KiB, past the 256 KiB that client-side ``kubectl apply``
stores in its last-applied annotation.

    hack/crd-schema.sh                 # start an API server from the cached binaries
                                       # (hack/cluster-binaries.sh), read its OpenAPI
    hack/crd-schema.sh --kubeconfig K  # or read any cluster's
    hack/crd-schema.sh --openapi F     # or a saved /openapi/v3/api/v1
    hack/crd-schema.sh --check         # exit 1 if the CRDs would change

A block may also name one of ctj's own functions (``LOCAL_BLOCKS``): the rules on a
job's name come from operator/ctj_operator/names.py, where the limit is computed, so the
number is never typed twice. ``--local`` rewrites only those, with no API server.

    hack/crd-schema.sh --local         # the blocks from ctj's own code only

The hand-written rest of the CRD (ctj's own fields, CEL rules, descriptions) is edited
in crds/ directly; run this afterwards to copy it to the chart.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ctj_operator.names import crd_validations

ROOT = Path(__file__).resolve().parents[2]
CRD_NAME = "training.ctj.dev_checkpointedtrainingjobs.yaml"
CRDS = (ROOT / "crds" / CRD_NAME, ROOT / "charts" / "ctj" / "crds" / CRD_NAME)
OPENAPI_PATH = "/openapi/v3/api/v1"

BEGIN = re.compile(r"^(?P<indent> *)# BEGIN generated: (?P<name>\S+)")
END = re.compile(r"^ *# END generated")

QUANTITY = "io.k8s.apimachinery.pkg.api.resource.Quantity"
INT_OR_STRING = "io.k8s.apimachinery.pkg.util.intstr.IntOrString"
TIME = (
    "io.k8s.apimachinery.pkg.apis.meta.v1.Time",
    "io.k8s.apimachinery.pkg.apis.meta.v1.MicroTime",
)
OBJECT_META = "io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"
TEMPLATE_META = ("annotations", "finalizers", "labels", "name", "namespace")
"""What controller-gen keeps of an embedded ObjectMeta (generateEmbeddedObjectMeta)."""
QUANTITY_PATTERN = (
    r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|"
    r"([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$"
)


LOCAL_BLOCKS: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
    "ctj_operator.names.crd_validations": ("operator/ctj_operator/names.py", crd_validations),
}
"""Blocks written from ctj's own code, not from the API server's OpenAPI: name -> (the
file it comes from, a function returning the YAML mapping to write)."""
OMITTED = {"io.k8s.api.core.v1.PodSpec": ("ephemeralContainers",)}
"""Fields a template cannot carry: a pod is never created with ephemeral containers (the
API server refuses them), and their schema would be a third of the template's. Left out,
``kubectl apply`` reports the field unknown."""
KEPT = (
    "type",
    "format",
    "enum",
    "required",
    "x-kubernetes-list-type",
    "x-kubernetes-list-map-keys",
    "x-kubernetes-map-type",
)
"""What a structural schema takes as it is; the rest (patch strategies, unions, group-
version-kinds, oneOf) is the built-in types' own business."""


def short_description(text: str) -> str:
    """The first sentence: the enum list and the "More info" link go (the enum itself is
    kept as ``enum``), so do the paragraphs a field's own documentation holds."""
    text = text.split("\n\nPossible enum values:")[0].strip()
    first = text.split("\n")[0].strip()
    # a sentence ends at ". " before a capital; "e.g. " and "i.e. " do not end one
    match = re.search(r"(?<!\be\.g)(?<!\bi\.e)(?<!\betc)\.\s+(?=[A-Z`\"(])", first)
    sentence = first[: match.start() + 1] if match else first
    return sentence.strip()


def _definition(schemas: Mapping[str, Any], node: Mapping[str, Any]) -> str | None:
    ref = node.get("$ref")
    if ref is None:
        refs = [s["$ref"] for s in node.get("allOf") or () if "$ref" in s]
        ref = refs[0] if refs else None
    if ref is None:
        return None
    name = str(ref).rsplit("/", 1)[-1]
    if name not in schemas:
        raise KeyError(f"{ref} is not in the OpenAPI document's components.schemas")
    return name


def structural(
    schemas: Mapping[str, Any], node: Mapping[str, Any], path: tuple[str, ...] = ()
) -> dict[str, Any]:
    """``node`` (an OpenAPI v3 schema of the API server) as a structural CRD schema."""
    described = node.get("description")
    name = _definition(schemas, node)
    if name is not None:
        if name in path:
            raise ValueError(f"{' -> '.join((*path, name))}: a recursive type cannot be inlined")
        path = (*path, name)
        node = {**schemas[name], **{k: v for k, v in node.items() if k not in ("$ref", "allOf")}}
    out: dict[str, Any] = {}
    if described or node.get("description"):
        out["description"] = short_description(str(described or node["description"]))
    if name in (QUANTITY, INT_OR_STRING):
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
        if name == QUANTITY:
            out["pattern"] = QUANTITY_PATTERN
        out["x-kubernetes-int-or-string"] = True
        return out
    if name in TIME:
        return {**out, "type": "string", "format": "date-time"}
    for key in KEPT:
        if key in node:
            out[key] = node[key]
    properties = dict(node.get("properties") or {})
    properties = {k: v for k, v in properties.items() if k not in OMITTED.get(name or "", ())}
    if name == OBJECT_META:
        properties = {k: v for k, v in properties.items() if k in TEMPLATE_META}
        out["type"] = "object"
    if properties:
        out["properties"] = {
            key: structural(schemas, value, path) for key, value in sorted(properties.items())
        }
    if "items" in node:
        out["items"] = structural(schemas, node["items"], path)
        keys = set(node.get("x-kubernetes-list-map-keys") or ())
        item = _definition(schemas, node["items"])
        if keys and item is not None:  # a list-map key must be required or defaulted
            for key in keys & set(schemas[item].get("properties") or {}):
                default = schemas[item]["properties"][key].get("default")
                if default is not None and key not in (schemas[item].get("required") or ()):
                    out["items"]["properties"][key]["default"] = default
    if "additionalProperties" in node and isinstance(node["additionalProperties"], Mapping):
        out["additionalProperties"] = structural(schemas, node["additionalProperties"], path)
    return out


def properties_of(schemas: Mapping[str, Any], definition: str) -> dict[str, Any]:
    """The ``properties`` of one definition, as the CRD embeds them."""
    return dict(structural(schemas, {"$ref": definition})["properties"])


def splice(crd: str, schemas: Mapping[str, Any] | None, source: str) -> str:
    """``crd`` with each generated block rewritten: from ``schemas`` (the OpenAPI's, read
    from ``source``), or from ctj's own code for LOCAL_BLOCKS. ``schemas`` None: the
    OpenAPI blocks are kept as they are."""
    import yaml

    lines, out, i = crd.splitlines(keepends=True), [], 0
    while i < len(lines):
        begin = BEGIN.match(lines[i])
        if begin is None:
            out.append(lines[i])
            i += 1
            continue
        indent, name = begin["indent"], begin["name"]
        end = next((j for j in range(i + 1, len(lines)) if END.match(lines[j])), None)
        if end is None:
            raise ValueError(f"line {i + 1}: '# BEGIN generated: {name}' has no '# END generated'")
        if name in LOCAL_BLOCKS:
            origin, make = LOCAL_BLOCKS[name]
            content = make()
        elif schemas is None:
            out.extend(lines[i : end + 1])
            i = end + 1
            continue
        else:
            origin, content = source, {"properties": properties_of(schemas, name)}
        body = yaml.safe_dump(content, sort_keys=False, width=10_000, default_flow_style=False)
        out.append(f"{indent}# BEGIN generated: {name} from {origin} (hack/crd-schema.sh)\n")
        out.extend(f"{indent}{line}\n" for line in body.splitlines())
        out.append(lines[end])
        i = end + 1
    return "".join(out)


def fetch_openapi(kubeconfig: Path | None) -> dict[str, Any]:
    """``/openapi/v3/api/v1`` of the cluster ``kubeconfig`` names or, without one, of an
    API server started from the cluster tier's cached binaries for this call."""
    if kubeconfig is not None:
        return _get_openapi(kubeconfig)
    from ctj_devcluster import find_binaries
    from ctj_devcluster.controlplane import ControlPlane, ControlPlaneConfig

    with tempfile.TemporaryDirectory(prefix="ctj-openapi-") as root:
        plane = ControlPlane(ControlPlaneConfig(root=Path(root)), find_binaries()).start()
        try:
            return _get_openapi(plane.admin_kubeconfig)
        finally:
            plane.stop()


def _get_openapi(kubeconfig: Path) -> dict[str, Any]:
    from kubernetes import config

    api = config.new_client_from_config(str(kubeconfig))
    response = api.call_api(
        OPENAPI_PATH, "GET", _preload_content=False, auth_settings=["BearerToken"]
    )[0]
    found: dict[str, Any] = json.loads(response.data)
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--openapi", type=Path, help="a saved /openapi/v3/api/v1 document")
    parser.add_argument("--kubeconfig", type=Path, help="read the OpenAPI of this cluster")
    parser.add_argument("--save-openapi", type=Path, help="also write the document read here")
    parser.add_argument("--check", action="store_true", help="exit 1 if a CRD would change")
    parser.add_argument(
        "--local", action="store_true", help="only the blocks from ctj's own code: no API server"
    )
    args = parser.parse_args(argv)
    schemas: Mapping[str, Any] | None = None
    source = "ctj's own code"
    if not args.local:
        if args.openapi is not None:
            document = json.loads(args.openapi.read_text())
        else:
            document = fetch_openapi(args.kubeconfig)
        if args.save_openapi is not None:
            args.save_openapi.write_text(json.dumps(document))
        source = f"Kubernetes {document['info']['version']} {OPENAPI_PATH}"
        schemas = document["components"]["schemas"]
    generated = splice(CRDS[0].read_text(), schemas, source)
    changed = [path for path in CRDS if path.read_text() != generated]
    if args.check:
        for path in changed:
            print(f"{path.relative_to(ROOT)} is not what {source} generates", file=sys.stderr)
        return 1 if changed else 0
    for path in changed:
        path.write_text(generated)
        print(f"wrote {path.relative_to(ROOT)} ({len(generated.encode()) // 1024} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
