"""The e2e tier: ctj on a real cluster with real kubelets, our own images, an S3 server
in the cluster, all through the tools a user has (helm, kubectl).

It runs against whatever cluster CTJ_E2E_KUBECONFIG names (never a plain KUBECONFIG,
so a test run cannot wander onto a cluster by accident), with our images named by
CTJ_OPERATOR_IMAGE, CTJ_TRAINER_IMAGE and CTJ_SEAWEEDFS_IMAGE, already on its nodes.
Node loss needs CTJ_E2E_NODE_STOP/START (``docker kill {node}``/``docker start {node}``
on kind). ./hack/test.sh sets all of it on the kind cluster hack/kind/cluster.sh builds,
or CTJ_E2E_SKIP_REASON when no container runtime can run here: the tier then skips,
with that reason in the summary. docs/e2e.md: running it against your own cluster.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from ctj_stack import Images, NodeControl, S3Credentials, Stack
from ctj_stack.health import cluster_problems
from ctj_stack.stack import OPERATOR_NAMESPACE


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "tests/e2e/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(pytest.mark.e2e)


# Steps of one scenario (a class marked ``incremental``) run in order on one job: after a
# step fails, the later ones are reported as xfailed ("the step before failed"), not as
# failures of their own.
_failed_step: dict[str, str] = {}


def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[Any]) -> None:
    failed = call.excinfo is not None and not call.excinfo.errisinstance(pytest.skip.Exception)
    if "incremental" in item.keywords and failed and item.parent:
        _failed_step.setdefault(item.parent.nodeid, item.name)


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "incremental" in item.keywords and item.parent:
        failed = _failed_step.get(item.parent.nodeid)
        if failed:
            pytest.xfail(f"the step before failed ({failed})")


@pytest.fixture(scope="session")
def stack() -> Stack:
    reason = os.environ.get("CTJ_E2E_SKIP_REASON")
    if reason:
        pytest.skip(f"e2e tier: {reason}")
    kubeconfig = os.environ.get("CTJ_E2E_KUBECONFIG")
    if not kubeconfig:
        pytest.skip("e2e tier: CTJ_E2E_KUBECONFIG is not set (./hack/test.sh sets it on kind)")
    try:
        images = Images.from_env()
    except ValueError as exc:
        pytest.fail(f"e2e tier: {exc}")
    stack = Stack(Path(kubeconfig), images, log=lambda line: print(f"e2e: {line}", flush=True),
                  nodes=NodeControl.from_env())  # fmt: skip
    # first: a broken cluster fails the tier now, with its reason, not after every timeout
    problems = cluster_problems(stack.core, images.trainer, stack.log)
    if problems:
        pytest.fail("e2e tier: the cluster cannot run it: " + "; ".join(problems), pytrace=False)
    _STACKS.append(stack)
    return stack


_STACKS: list[Stack] = []
"""The session's stack, once made (``_nodes_back`` reads it without making one)."""


@pytest.fixture(scope="session")
def node_control(stack: Stack) -> NodeControl:
    """How the stack stops and starts a node; the steps that need it skip where none is
    given."""
    if stack.nodes is None:
        pytest.skip("CTJ_E2E_NODE_STOP/START are not set: no way to stop a node here")
    return stack.nodes


@pytest.fixture(scope="class", autouse=True)
def _nodes_back() -> Iterator[None]:
    """After each scenario (a class; the module's own tests, outside one), every node it
    stopped runs again: a node-loss step that failed before the node's return leaves no
    later scenario a node short."""
    yield
    for stack in _STACKS:
        stack.start_stopped_nodes()


@pytest.fixture(scope="session")
def kubeflow(stack: Stack) -> str:
    """Kubeflow's PyTorchJob controller, for the pytorchjob backend: ours (deploy/kubeflow)
    where CTJ_KUBEFLOW_IMAGE names its image, else the cluster's own if it serves
    PyTorchJobs. Installed before the operator, which then watches PyTorchJobs. Returns
    "" when there is one, else why not (the backend's scenario skips with it)."""
    if stack.images.kubeflow:
        stack.install_kubeflow(control_plane=bool(stack.control_plane_nodes()))
        return ""
    if stack.serves_pytorchjobs():
        stack.log("Kubeflow's controller: the cluster's own (it serves PyTorchJobs)")
        return ""
    return "the cluster serves no PyTorchJobs and CTJ_KUBEFLOW_IMAGE is not set"


@pytest.fixture(scope="session")
def trainer(stack: Stack) -> str:
    """Kubeflow Trainer v2 and JobSet, for the trainjob backend: ours (built from their Go
    modules, hack/cluster-binaries.sh) where CTJ_KUBEFLOW_TRAINER_IMAGE and
    CTJ_JOBSET_IMAGE name their images. Installed before the operator, which then watches
    TrainJobs. Returns "" when installed, else why not (the backend's scenario skips)."""
    if not (stack.images.kubeflow_trainer and stack.images.jobset):
        return "CTJ_KUBEFLOW_TRAINER_IMAGE and CTJ_JOBSET_IMAGE are not set"
    stack.install_trainer(control_plane=bool(stack.control_plane_nodes()))
    return ""


@pytest.fixture(scope="session")
def operator_installed(stack: Stack, kubeflow: str, trainer: str) -> Iterator[str]:
    """The chart, installed as a user would, its operator on a control-plane node where
    the cluster has one (losing a worker then loses training pods only). Yields the
    operator's namespace."""
    namespace = OPERATOR_NAMESPACE
    stack.install_operator(namespace, control_plane=bool(stack.control_plane_nodes()))
    yield namespace
    stack.uninstall_operator(namespace)


@pytest.fixture(scope="session")
def s3_credentials(stack: Stack) -> S3Credentials:
    credentials = S3Credentials()
    stack.install_s3(credentials)
    return credentials


@pytest.fixture(scope="module")
def job_namespace(stack: Stack, s3_credentials: S3Credentials) -> Iterator[str]:
    namespace = f"ctj-e2e-{secrets.token_hex(3)}"
    stack.job_namespace(namespace, s3_credentials)
    yield namespace
    stack.kubectl("delete", "namespace", namespace, "--wait=false")
