"""Names that always fit: the longest job name whose derived names fit at any attempt.

A job's name reaches Kubernetes again in names made from it: the headless Service
``<job>``, each rank's pod and hostname ``<job>-a<attempt>-<rank>``, the PyTorchJob
``<job>-a<attempt>`` and the pods and Services Kubeflow's controller makes from that
(``<pytorchjob>-master-0``, ``<pytorchjob>-worker-<i>``), the TrainJob
``<job>-a<attempt>`` and the JobSet, Job and hostnames made from it
(``<trainjob>-node-0-<rank>``), label values. Each of those is
limited to 63 characters, and the longest grow with the attempt (a counter that every
restart and planned resize raises) and the rank. A name that fits today could fail at
attempt 100 or rank 10, every attempt after that refused as PodRejected.

So the CRD refuses, at ``kubectl apply``, a name that could ever be too long: it allows
attempts up to ``MAX_ATTEMPT`` and ranks below ``MAX_REPLICAS`` (the CRD's maximum of
``spec.maxReplicas``), and ``max_name_length`` is what the longest derived name leaves
of 63 characters at those bounds, computed here from the builders' own name functions.
``crd_validations`` is the CEL the CRD carries, written into it by hack/crd-schema.sh
(``--local`` needs no API server); tests/unit/test_names.py checks the CRD against it
and every object the builders make for the longest admitted name.

Why a limit and not shorter names (a hash of a long name): the derived names stay
readable and predictable (``kubectl get pod <job>-a3-0``, ``MASTER_ADDR``, logs), the
operator keeps finding its objects by name; Kubernetes makes the same trade for a CronJob
(at most 52 characters, so the Jobs named after it fit).
"""

from __future__ import annotations

import dataclasses
import enum
import re
from typing import Any

from ctj_contract import LABEL_JOB

from .builders import attempt_name, rank_pod_name
from .spec import Backend, JobSpec

MAX_ATTEMPT = 999_999_999
"""The last attempt a job's names have room for: a billion restarts and resizes, one a
second for 31 years. ``attempt_problem`` refuses the one after, rather than make it."""
MAX_REPLICAS = 99_999
"""The CRD's maximum of spec.maxReplicas: ranks 0..99998, one node each (GKE's largest
clusters have 65,000 nodes)."""

KUBEFLOW_JOB_LABEL = "training.kubeflow.org/job-name"
"""The label Kubeflow's controller puts on a PyTorchJob's pods: the PyTorchJob's name."""
JOBSET_NAME_LABEL = "jobset.sigs.k8s.io/jobset-name"
"""The label JobSet puts on its Jobs and pods: the JobSet's (the TrainJob's) name."""


class Rule(enum.Enum):
    """What Kubernetes requires of a name, as k8s.io/apimachinery/pkg/util/validation."""

    DNS1035_LABEL = (r"[a-z]([-a-z0-9]*[a-z0-9])?", 63)
    """A Service's name (and Kubeflow's PyTorchJob's: its webhook asks the same)."""
    DNS1123_LABEL = (r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", 63)
    """A pod's hostname and subdomain."""
    LABEL_VALUE = (r"(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?", 63)
    DNS1123_SUBDOMAIN = (r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*", 253)
    """Most objects' names: pods, Secrets, Leases, Roles, NetworkPolicies."""

    def __init__(self, pattern: str, max_length: int) -> None:
        self.pattern, self.max_length = pattern, max_length

    def problem(self, value: str) -> str | None:
        """Why ``value`` breaks the rule, or None."""
        if len(value) > self.max_length:
            return f"{len(value)} characters, more than {self.max_length}"
        if not re.fullmatch(self.pattern, value):
            return f"not {self.name.lower().replace('_', ' ')} (^{self.pattern}$)"
        return None


@dataclasses.dataclass(frozen=True, slots=True)
class Derived:
    """One name made from a job's name, and the rule it must meet."""

    what: str
    value: str
    rule: Rule


def _probe(backend: Backend) -> JobSpec:
    """The least spec that names pods as ``backend`` does (rank_pod_name reads only it)."""
    return JobSpec.parse(
        {
            "backend": backend.value,
            "template": {"spec": {"containers": [{"name": "trainer"}]}},
            "checkpoint": {"uri": "s3://bucket"},
        }
    )


def derived_names(job: str, backend: Backend, *, attempt: int, rank: int) -> tuple[Derived, ...]:
    """The names limited to 63 characters that ``job`` gives at ``attempt``, ``rank``
    (subdomain names, e.g. the Secret ``<job>-ctj-cache``, have 253 and fit anyway)."""
    names = [Derived(f"label {LABEL_JOB}", job, Rule.LABEL_VALUE)]
    pod = rank_pod_name(_probe(backend), job, attempt, rank)
    if backend is Backend.PYTORCHJOB:
        pytorchjob = attempt_name(job, attempt)
        return (
            *names,
            Derived("the PyTorchJob", pytorchjob, Rule.DNS1035_LABEL),
            Derived(f"label {KUBEFLOW_JOB_LABEL}", pytorchjob, Rule.LABEL_VALUE),
            Derived("Kubeflow's pod and Service of the rank", pod, Rule.DNS1035_LABEL),
        )
    if backend is Backend.TRAINJOB:
        trainjob = attempt_name(job, attempt)
        return (
            *names,
            Derived("the TrainJob, its JobSet and their Service", trainjob, Rule.DNS1035_LABEL),
            Derived(f"label {JOBSET_NAME_LABEL}", trainjob, Rule.LABEL_VALUE),
            Derived("the rank's pod hostname", pod, Rule.DNS1123_LABEL),
            # the Job controller names the pod <hostname>-<5 random characters>, and
            # JobSet's webhook holds that name to a DNS label too
            Derived("the rank's pod name", f"{pod}-{'x' * 5}", Rule.DNS1123_LABEL),
        )
    return (
        *names,
        Derived("the headless Service", job, Rule.DNS1035_LABEL),
        Derived("the pods' subdomain", job, Rule.DNS1123_LABEL),
        Derived("the rank's pod hostname", pod, Rule.DNS1123_LABEL),
    )


def max_name_length(backend: Backend) -> int:
    """The longest job name whose every derived name fits at any attempt up to
    MAX_ATTEMPT and any rank below MAX_REPLICAS (the longest are at both maxima)."""
    worst = [
        derived
        for attempt in (1, MAX_ATTEMPT)
        for rank in (0, MAX_REPLICAS - 1)
        for derived in derived_names("", backend, attempt=attempt, rank=rank)
    ]
    return min(d.rule.max_length - len(d.value) for d in worst)


FORM_MESSAGE = (
    "metadata.name must be a DNS-1035 label (lowercase letters, digits and '-', starting"
    " with a letter and ending with a letter or a digit): the job's headless Service and its"
    " pods' DNS names are named after it. Rename the job, e.g. train-1b, not 1b-train or"
    " train.1b"
)


def length_message() -> str:
    pods, kubeflow = max_name_length(Backend.PODS), max_name_length(Backend.PYTORCHJOB)
    trainjob = max_name_length(Backend.TRAINJOB)
    return (
        f"metadata.name must be at most {pods} characters ({kubeflow} with spec.backend"
        f" pytorchjob, {trainjob} with trainjob), so that every name derived from it fits"
        f" Kubernetes' 63-character limit at any attempt and rank: the pods and their"
        f" hostnames <name>-a<attempt>-<rank> (under Kubeflow <name>-a<attempt>-worker-<i>"
        f" or <name>-a<attempt>-node-0-<rank>), for up to {MAX_ATTEMPT} attempts and"
        f" {MAX_REPLICAS} replicas. Choose a shorter name"
    )


def _length_limit_cel() -> str:
    """``max_name_length`` of the job's backend, as CEL (the default backend's last)."""
    default = Backend.PODS
    expr = str(max_name_length(default))
    for backend in Backend:
        if backend is not default:
            chosen = f"has(self.spec.backend) && self.spec.backend == '{backend.value}'"
            expr = f"(({chosen}) ? {max_name_length(backend)} : {expr})"
    return expr


def crd_validations() -> dict[str, Any]:
    """The CRD's root ``x-kubernetes-validations`` on metadata.name.

    Checked at create only (``optionalOldSelf``: ``oldSelf`` has no value then). A name
    never changes, and a job stored before the rule existed must stay writable: checked
    on every update, its status, finalizers and deletion would all be refused (an update
    of the root changes ``self``, so ratcheting does not spare it)."""
    limit, dns1035 = _length_limit_cel(), Rule.DNS1035_LABEL.pattern
    return {
        "x-kubernetes-validations": [
            {
                "rule": f"oldSelf.hasValue() || self.metadata.name.matches('^{dns1035}$')",
                "optionalOldSelf": True,
                "message": FORM_MESSAGE,
                "reason": "FieldValueInvalid",
            },
            {
                "rule": f"oldSelf.hasValue() || self.metadata.name.size() <= {limit}",
                "optionalOldSelf": True,
                "message": length_message(),
                "reason": "FieldValueInvalid",
            },
        ]
    }


def name_problem(name: str, backend: Backend) -> str | None:
    """What the CRD's rules say of ``name`` (None: admitted), in Python."""
    if not re.fullmatch(Rule.DNS1035_LABEL.pattern, name):
        return FORM_MESSAGE
    if len(name) > max_name_length(backend):
        return length_message()
    return None


def attempt_problem(job: str, backend: Backend, *, attempt: int, world_size: int) -> str | None:
    """Why the attempt ``attempt`` of ``world_size`` ranks cannot be named (None: it can):
    for a job stored before the CRD had its name rules, or past MAX_ATTEMPT. Failing the
    job with this beats making pods the API server refuses, attempt after attempt."""
    if attempt > MAX_ATTEMPT:
        return f"attempt {attempt} is past the last one a job's names have room for ({MAX_ATTEMPT})"
    for rank in {0, world_size - 1}:
        for derived in derived_names(job, backend, attempt=attempt, rank=rank):
            problem = derived.rule.problem(derived.value)
            if problem is not None:
                return (
                    f"{derived.what} would be {derived.value!r}: {problem}. Re-create the job"
                    f" with a name of at most {max_name_length(backend)} characters"
                )
    return None
