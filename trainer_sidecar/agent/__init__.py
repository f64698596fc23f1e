"""The node agent: the node tier of every job on one node (a DaemonSet, one pod per node).

Training pods get no hostPath: the agent alone holds the node's chunk cache on the
node's disk (store.py), serves it to each job's pods, on this node and on others,
authenticated per job (server.py), and removes a deleted job's data (gc.py).
``python -m trainer_sidecar agent`` runs it (main.py). Imports neither torch nor kopf.
"""
