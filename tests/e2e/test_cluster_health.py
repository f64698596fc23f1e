"""The tier's health check (ctj_stack.health, run before every other e2e test) finds a
broken cluster network: with CoreDNS scaled to nothing, the probe on every node says that
DNS fails and names the name. CoreDNS is scaled back and Ready before the test ends."""

from __future__ import annotations

from ctj_stack import Stack
from ctj_stack.health import API_NAME, network_problems


def test_a_cluster_without_dns_is_reported_on_every_node(stack: Stack) -> None:
    scale = stack.apps.read_namespaced_deployment_scale("coredns", "kube-system")
    replicas = scale.spec.replicas

    def set_replicas(n: int) -> None:
        stack.apps.patch_namespaced_deployment_scale(
            "coredns", "kube-system", {"spec": {"replicas": n}}
        )

    def dns_pods() -> list[object]:
        return list(
            stack.core.list_namespaced_pod("kube-system", label_selector="k8s-app=kube-dns").items
        )

    set_replicas(0)
    try:
        stack.wait(lambda: not dns_pods(), "CoreDNS's pods gone", 90)
        problems = network_problems(stack.core, stack.images.trainer, log=stack.log)
    finally:
        set_replicas(replicas)
        stack.wait(
            lambda: (
                stack.apps.read_namespaced_deployment(
                    "coredns", "kube-system"
                ).status.ready_replicas
                == replicas
            ),
            "CoreDNS Ready again",
            120,
        )
    nodes = [n.metadata.name for n in stack.core.list_node().items]
    assert len(problems) == len(nodes), problems
    for node, problem in zip(sorted(nodes), problems, strict=True):
        assert problem.startswith(f"node {node}: DNS: {API_NAME}"), problem
