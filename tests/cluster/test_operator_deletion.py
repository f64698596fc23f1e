"""Deleting a job removes everything it made: the garbage collector follows ownerReferences."""

from __future__ import annotations

import pytest
from ctj_contract import GROUP, PLURAL, VERSION
from ctj_devcluster import Cluster
from ctj_stack.jobs import FAST_TRAINING, NewJob, core, custom, job_pods, running, wait_for
from kubernetes.client.exceptions import ApiException

pytestmark = pytest.mark.cluster


def _gone(fn: object, *args: str) -> bool:
    try:
        fn(*args)  # type: ignore[operator]
    except ApiException as exc:
        if exc.status == 404:
            return True
        raise
    return False


def test_deleting_the_job_removes_its_pods_and_service(
    op_cluster: Cluster, job_namespace: str, new_job: NewJob
) -> None:
    ns, name = job_namespace, "doomed"
    new_job(name, env=FAST_TRAINING, replicas=2)
    wait_for(lambda: running(op_cluster, ns, name, 1, 2), "the job to run", 90)
    api = core(op_cluster)
    svc = api.read_namespaced_service(name, ns)
    assert svc.metadata.owner_references[0].name == name
    assert all(p.metadata.owner_references[0].controller for p in job_pods(op_cluster, ns, name))

    custom(op_cluster).delete_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
    wait_for(
        lambda: _gone(
            custom(op_cluster).get_namespaced_custom_object, GROUP, VERSION, ns, PLURAL, name
        ),
        "the job gone",
        30,
    )
    wait_for(lambda: not job_pods(op_cluster, ns, name), "its pods gone", 60)
    wait_for(lambda: _gone(api.read_namespaced_service, name, ns), "its Service gone", 30)
    # and the operator does not bring anything back
    assert not job_pods(op_cluster, ns, name)
