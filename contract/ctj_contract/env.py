"""The environment variables the operator sets in a rank's containers (re-exported by
``ctj_contract``; its own module so that ``ctj_contract.launch`` can use it)."""

from __future__ import annotations


class Env:
    """The ``CTJ_*`` (and AWS's, and torch's) variables the operator sets in a rank's
    containers, by what they carry. Plain strings: they go into objects sent as JSON."""

    # where and how to save (trainer and sidecar)
    CHECKPOINT_URI = "CTJ_CHECKPOINT_URI"
    CHECKPOINT_MODE = "CTJ_CHECKPOINT_MODE"
    CHECKPOINT_FULL_EVERY = "CTJ_CHECKPOINT_FULL_EVERY"
    CHECKPOINT_KEEP_LAST = "CTJ_CHECKPOINT_KEEP_LAST"
    STAGING_DIR = "CTJ_STAGING_DIR"
    SIDECAR = "CTJ_SIDECAR"
    """"1": a sidecar process persists what the trainer stages."""
    RESUME_FROM = "CTJ_RESUME_FROM"
    """A job with no committed checkpoint of its own is seeded from the newest committed one
    here (spec.checkpoint.resumeFrom), read-only: a checkpoint location URI; or, with
    ``RESUME_FROM_JOB``, the directory that holds a job's locations (``<uri>/<namespace>``)."""
    RESUME_FROM_JOB = "CTJ_RESUME_FROM_JOB"
    """spec.checkpoint.resumeFrom named a job: its locations are ``RESUME_FROM/<name>-<uid>``
    (every uid the name had); the trainer seeds from the newest commit among them."""
    S3_ENDPOINT = "AWS_ENDPOINT_URL"
    S3_ACCESS_KEY = "AWS_ACCESS_KEY_ID"
    S3_SECRET_KEY = "AWS_SECRET_ACCESS_KEY"
    # the trainer
    SAVE_EVERY = "CTJ_SAVE_EVERY"
    PRELOAD = "CTJ_PRELOAD"
    """Set by the user in the trainer's environment (e.g. "torch"): the launcher keeps a
    Python process with these modules imported, ready to become the next worker."""
    STANDBY = "CTJ_STANDBY"
    """"1" on a warm spare: its launcher starts no worker until an assignment arrives."""
    ATTEMPT = "CTJ_ATTEMPT"
    """Part of every save's identity: nothing an older attempt left can enter a commit."""
    NODE_RANK = "NODE_RANK"
    # the sidecar
    METRICS_HOST = "CTJ_METRICS_HOST"
    # the node-local chunk cache and its peers
    CACHE_PEERS = "CTJ_CACHE_PEERS"
    """host:port of every pod's cache server, in node-rank order, comma-separated."""
    CACHE_TOKEN = "CTJ_CACHE_TOKEN"
    """The job's token (``ctj_contract.tokens``): its peers', its node agents' and the
    operator's heartbeat requests carry it. Set in every rank's sidecar, from the job's
    Secret."""
    CACHE_PORT = "CTJ_CACHE_PORT"
    # the node agent (a DaemonSet) that holds the node's cache: training pods have no hostPath
    NODE_AGENT_HOST = "CTJ_NODE_AGENT_HOST"
    """The node's address (the downward API's status.hostIP): the agent's hostPort is there."""
    NODE_AGENT_PORT = "CTJ_NODE_AGENT_PORT"
    NODE_CACHE_MOUNT = "CTJ_NODE_CACHE_MOUNT"
    """Where the job's directory of the node cache is mounted read-only (the agent's CSI
    volume): the trainer reads its own node's chunks there; writes still go to the agent."""
    JOB_NAMESPACE = "CTJ_JOB_NAMESPACE"
    JOB_NAME = "CTJ_JOB_NAME"
    JOB_UID = "CTJ_JOB_UID"
    """The job's identity: its path on the node agents, and what its token derives from
    (``ctj_contract.tokens``)."""
