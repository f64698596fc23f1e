"""ctj's stack on a real cluster (any KUBECONFIG): the chart with our operator image, the
in-cluster S3 server, the example job; and reading the job back (status, trainer events).

Shared by the e2e tests (tests/e2e) and the kind demo (``python -m ctj_stack demo``), so
the demo shows exactly what the tests check.
"""

from .stack import Images, NodeControl, S3Credentials, Stack, Tools

__all__ = ["Images", "NodeControl", "S3Credentials", "Stack", "Tools"]
