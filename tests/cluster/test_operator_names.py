"""A job's name against the real API server: the CRD refuses at apply a name whose derived
names could ever be too long (operator/ctj_operator/names.py computes the limit), or that
no Service can carry, and admits the longest that always fits; a job stored before the
rule existed stays writable. A control plane without nodes: no pod runs here.

tests/unit/test_names.py builds every object the operator makes for the longest admitted
name; this file shows the API server draws the line where names.py does.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from ctj_contract import GROUP, PLURAL, VERSION
from ctj_devcluster import Binaries, Cluster, ClusterConfig
from ctj_operator.names import (
    FORM_MESSAGE,
    MAX_REPLICAS,
    length_message,
    max_name_length,
    name_problem,
)
from ctj_operator.spec import Backend
from ctj_stack.jobs import CRD, create_job, custom, get_job, install_crd, job_manifest, wait_for
from kubernetes import client
from kubernetes.client.exceptions import ApiException

pytestmark = pytest.mark.cluster

OLD_NAME = "stored-before-the-rule-" + "x" * 30  # 53 characters: too long today
GENERATED_BLOCK = re.compile(
    r"^ *# BEGIN generated: ctj_operator\.names\.crd_validations.*?^ *# END generated\n",
    re.MULTILINE | re.DOTALL,
)


def crd_without_the_name_rules() -> str:
    """The CRD as it was before the rules on metadata.name."""
    text = CRD.read_text()
    without, found = GENERATED_BLOCK.subn("", text)
    assert found == 1, "the CRD has no generated block of name rules"
    return without


@pytest.fixture(scope="module")
def names_cluster(
    cluster_binaries: Binaries, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    """A control plane whose CRD gained the name rules after OLD_NAME was stored."""
    c = Cluster(
        ClusterConfig(root=tmp_path_factory.mktemp("namescluster"), nodes=0), cluster_binaries
    )
    c.start()
    try:
        c.kubectl("apply", "-f", "-", input=crd_without_the_name_rules())
        c.wait_crd_established(f"{PLURAL}.{GROUP}")
        client.CoreV1Api(c.api_client()).create_namespace({"metadata": {"name": "before"}})
        create_job(c, "before", manifest(OLD_NAME))
        install_crd(c)  # the CRD of this checkout: kubectl apply, as an upgrade does
        # the API server takes a CRD's new schema a moment after the update
        wait_for(lambda: refused(c, "before", manifest(of_length(60))), "the name rules", 30)
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def ns(names_cluster: Cluster) -> str:
    name = f"names-{uuid.uuid4().hex[:6]}"
    client.CoreV1Api(names_cluster.api_client()).create_namespace({"metadata": {"name": name}})
    return name


def manifest(name: str, **spec: Any) -> dict[str, Any]:
    job = job_manifest(name, "s3://bucket/jobs", "http://s3:9000")
    job["spec"].update(spec)
    return job


def refused(cluster: Cluster, ns: str, job: dict[str, Any]) -> str:
    """The API server's message refusing ``job`` ("" if it was created)."""
    try:
        create_job(cluster, ns, job)
    except ApiException as exc:
        assert exc.status == 422, exc.body
        return str(json.loads(exc.body)["message"])
    return ""


def of_length(n: int) -> str:
    """A fresh DNS-1035 label of ``n`` characters."""
    return ("n" + uuid.uuid4().hex + "x" * n)[:n]


@pytest.mark.parametrize("backend", list(Backend), ids=lambda b: b.value)
def test_the_longest_admitted_name_is_accepted_and_one_longer_refused_naming_the_limit(
    names_cluster: Cluster, ns: str, backend: Backend
) -> None:
    longest = of_length(max_name_length(backend))
    stored = create_job(names_cluster, ns, manifest(longest, backend=backend.value))
    assert stored["metadata"]["name"] == longest
    body = refused(names_cluster, ns, manifest(of_length(len(longest) + 1), backend=backend.value))
    assert length_message() in body, body
    assert f"must be at most {max_name_length(Backend.PODS)} characters" in body


@pytest.mark.parametrize("name", ["1job", "a.b", "train.v2", "9"])
def test_a_name_no_service_can_carry_is_refused_saying_why(
    names_cluster: Cluster, ns: str, name: str
) -> None:
    """Valid object names (DNS-1123 subdomains), but the headless Service named after the
    job needs a DNS-1035 label: a letter first, no dots."""
    body = refused(names_cluster, ns, manifest(name))
    assert FORM_MESSAGE in body, body


def test_the_api_server_draws_the_line_where_names_py_does(names_cluster: Cluster, ns: str) -> None:
    """names.name_problem, the rule in Python, against the rule in the CRD."""
    cases = [
        (name, backend)
        for backend in Backend
        for name in (
            of_length(1),
            of_length(max_name_length(Backend.PYTORCHJOB)),
            of_length(max_name_length(Backend.PYTORCHJOB) + 1),
            of_length(max_name_length(Backend.PODS)),
            of_length(max_name_length(Backend.PODS) + 1),
            of_length(63),
            "0" + of_length(10),
            "a.b" + of_length(5),
            "a--b-" + of_length(5),
        )
    ]
    core = client.CoreV1Api(names_cluster.api_client())
    namespaces = {b: f"{ns}-{b.value}" for b in Backend}  # the 1-character names, once each
    for each in namespaces.values():
        core.create_namespace({"metadata": {"name": each}})
    disagree = []
    for name, backend in cases:
        body = refused(names_cluster, namespaces[backend], manifest(name, backend=backend.value))
        if bool(body) != (name_problem(name, backend) is not None):
            disagree.append((name, backend.value, body or "admitted"))
    assert not disagree, disagree


def test_a_generated_name_is_held_to_the_same_limit(names_cluster: Cluster, ns: str) -> None:
    """generateName: the API server adds 5 characters, then checks the rules on the name."""
    short = manifest("unused")
    del short["metadata"]["name"]
    short["metadata"]["generateName"] = "gen-"
    assert create_job(names_cluster, ns, short)["metadata"]["name"].startswith("gen-")
    long = manifest("unused")
    del long["metadata"]["name"]
    long["metadata"]["generateName"] = of_length(max_name_length(Backend.PODS) - 4) + "-"
    assert length_message() in refused(names_cluster, ns, long)


def test_max_replicas_is_bounded_as_the_names_assume(names_cluster: Cluster, ns: str) -> None:
    body = refused(names_cluster, ns, manifest(of_length(10), maxReplicas=MAX_REPLICAS + 1))
    assert "spec.maxReplicas" in body and str(MAX_REPLICAS) in body, body
    create_job(names_cluster, ns, manifest(of_length(10), maxReplicas=MAX_REPLICAS))


def test_a_job_stored_before_the_rule_stays_writable_and_deletable(
    names_cluster: Cluster,
) -> None:
    """The rules check a name at create only: an update never changes it, and a job
    stored before them (an upgrade) must keep its status, its edits, its deletion."""
    api = custom(names_cluster)

    def patch(body: dict[str, Any], status: bool = False) -> dict[str, Any]:
        call = (
            api.patch_namespaced_custom_object_status
            if status
            else api.patch_namespaced_custom_object
        )
        return call(GROUP, VERSION, "before", PLURAL, OLD_NAME, body)

    assert name_problem(OLD_NAME, Backend.PODS) is not None  # a name refused today
    running = patch({"status": {"phase": "Running", "attempt": 1}}, status=True)
    assert running["status"]["attempt"] == 1
    assert patch({"metadata": {"finalizers": ["ctj.dev/test"]}})["metadata"]["finalizers"]
    assert patch({"spec": {"replicas": 1}})["metadata"]["name"] == OLD_NAME
    api.delete_namespaced_custom_object(GROUP, VERSION, "before", PLURAL, OLD_NAME)
    assert get_job(names_cluster, "before", OLD_NAME)["metadata"].get("deletionTimestamp")
    patch({"metadata": {"finalizers": None}})  # the last update a deletion needs

    def gone() -> bool:
        try:
            get_job(names_cluster, "before", OLD_NAME)
        except ApiException as exc:
            return exc.status == 404
        return False

    wait_for(gone, f"{OLD_NAME} deleted", 30)


def test_the_crd_in_force_is_this_checkouts(names_cluster: Cluster) -> None:
    """The fixture's upgrade applied crds/ whole (the rules are not a test's own)."""
    served = yaml.safe_load(
        names_cluster.kubectl("get", "crd", f"{PLURAL}.{GROUP}", "-o", "yaml").stdout
    )
    rules = served["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["x-kubernetes-validations"]
    assert [r["message"] for r in rules] == [FORM_MESSAGE, length_message()]
    assert all(r.get("optionalOldSelf") for r in rules)
