"""A job name too long for the names the operator derives from it is refused at
``kubectl apply``, on kind's API server with the chart's CRD (the CEL rule on
``metadata.name``), in a message that names the limit; the longest admitted name passes.
Server-side dry runs: the API server admits or refuses, nothing is created.

The rules for every backend, and the API server against ctj_operator.names, are
tests/cluster/test_operator_names.py's; this is the same refusal where users meet it.
"""

from __future__ import annotations

import json

import pytest
from ctj_operator.names import length_message, max_name_length
from ctj_operator.spec import Backend
from ctj_stack import Stack


def dry_run_apply(stack: Stack, namespace: str, name: str) -> str:
    job = stack.example_job(name)
    return stack.kubectl("apply", "--dry-run=server", "-n", namespace, "-f", "-",
                         stdin=json.dumps(job))  # fmt: skip


def test_kubectl_apply_refuses_a_name_too_long_naming_the_limit(
    stack: Stack, operator_installed: str, job_namespace: str
) -> None:
    longest = max_name_length(Backend.PODS)
    out = dry_run_apply(stack, job_namespace, "n" * longest)
    assert "created (server dry run)" in out, out
    with pytest.raises(RuntimeError) as refused:
        dry_run_apply(stack, job_namespace, "n" * (longest + 1))
    message = str(refused.value)
    assert "metadata.name" in message and length_message() in message, message
