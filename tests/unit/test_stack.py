"""ctj_stack's pure parts: what it reads from the environment, the job it applies, and
what it never prints (no cluster here; tests/e2e runs it for real)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml
from ctj_stack import stack as st
from ctj_stack.harness import trainer_log_events

IMAGES = {
    "CTJ_OPERATOR_IMAGE": "ctj/operator:abc",
    "CTJ_TRAINER_IMAGE": "ctj/trainer:abc",
    "CTJ_SEAWEEDFS_IMAGE": "ctj/seaweedfs:def",
}


def test_images_come_from_the_environment_and_a_missing_one_is_named() -> None:
    assert st.Images.from_env(IMAGES) == st.Images("ctj/operator:abc", "ctj/trainer:abc",
                                                   "ctj/seaweedfs:def")  # fmt: skip
    with pytest.raises(ValueError, match="CTJ_TRAINER_IMAGE is not set.*images.sh"):
        st.Images.from_env({k: v for k, v in IMAGES.items() if k != "CTJ_TRAINER_IMAGE"})
    # Kubeflow's controller is optional: without it the cluster's own is used, if any
    assert st.Images.from_env(IMAGES).kubeflow == ""
    kf = {**IMAGES, "CTJ_KUBEFLOW_IMAGE": "ctj/training-operator:k"}
    assert st.Images.from_env(kf).kubeflow == "ctj/training-operator:k"


def test_jobset_s_and_kubeflow_trainer_s_images_come_from_the_environment() -> None:
    """hack/containers/images.sh prints them; install_trainer names the one missing
    before it looks for any build."""
    env = {**IMAGES, "CTJ_JOBSET_IMAGE": "ctj/jobset:j",
           "CTJ_KUBEFLOW_TRAINER_IMAGE": "ctj/kubeflow-trainer:t"}  # fmt: skip
    images = st.Images.from_env(env)
    assert (images.jobset, images.kubeflow_trainer) == ("ctj/jobset:j", "ctj/kubeflow-trainer:t")
    assert (st.Images.from_env(IMAGES).jobset, st.Images.from_env(IMAGES).kubeflow_trainer) == (
        "", ""
    )
    stack = st.Stack.__new__(st.Stack)
    stack.images = st.Images.from_env({**IMAGES, "CTJ_JOBSET_IMAGE": "ctj/jobset:j"})
    with pytest.raises(ValueError, match="CTJ_KUBEFLOW_TRAINER_IMAGE is not set.*images.sh"):
        stack.install_trainer()


@pytest.mark.parametrize("control_plane", [False, True])
def test_a_controller_s_manager_runs_our_image_never_pulled(control_plane: bool) -> None:
    """Kueue's, JobSet's and the trainer's rendered installs: only the Deployment changes."""
    container = {"name": "manager", "image": "registry.k8s.io/jobset/jobset:v0.12.0"}
    deployment = {"kind": "Deployment",
                  "spec": {"template": {"spec": {"containers": [container]}}}}  # fmt: skip
    service = {"kind": "Service", "spec": {"selector": {"app": "x"}}}
    objects = [deployment, yaml.safe_load(yaml.safe_dump(service))]
    st._run_manager(objects, "ctj/jobset:j", control_plane)
    pod = objects[0]["spec"]["template"]["spec"]
    assert pod["containers"] == [{"name": "manager", "image": "ctj/jobset:j",
                                  "imagePullPolicy": "IfNotPresent"}]  # fmt: skip
    assert objects[1] == service
    if control_plane:
        assert pod["nodeSelector"] == {st.CONTROL_PLANE_LABEL: ""}
        assert pod["tolerations"] == [st.CONTROL_PLANE_TOLERATION]
    else:
        assert "nodeSelector" not in pod and "tolerations" not in pod


def _chart_sets(env: dict[str, str]) -> list[str]:
    """The --set values install_operator gives helm."""
    stack = st.Stack.__new__(st.Stack)
    stack.images = st.Images.from_env(env)
    calls: list[tuple[str, ...]] = []

    def helm(*args: str) -> str:
        calls.append(args)
        return ""

    stack.log = lambda message: None
    stack.helm = helm  # type: ignore[method-assign]
    stack.install_operator()
    (args,) = calls
    return [args[i + 1] for i, a in enumerate(args) if a == "--set"]


def test_the_chart_gets_the_sidecar_image_or_else_the_trainer_s() -> None:
    """hack/containers/images.sh prints CTJ_SIDECAR_IMAGE (the torch-free target): the
    operator's default sidecar; a cluster given only the trainer image runs that."""
    sets = _chart_sets({**IMAGES, "CTJ_SIDECAR_IMAGE": "ctj/sidecar:s1"})
    assert "sidecarImage.repository=ctj/sidecar" in sets and "sidecarImage.tag=s1" in sets
    sets = _chart_sets(IMAGES)
    assert "sidecarImage.repository=ctj/trainer" in sets and "sidecarImage.tag=abc" in sets


@pytest.mark.parametrize(
    ("image", "split"),
    [("ctj/trainer:abc", ("ctj/trainer", "abc")),
     ("localhost:5000/ctj/trainer:1.0", ("localhost:5000/ctj/trainer", "1.0"))],
)  # fmt: skip
def test_repo_tag_splits_at_the_tag_not_a_registry_port(image: str, split: tuple) -> None:
    assert st._repo_tag(image) == split


@pytest.mark.parametrize("image", ["ctj/trainer", "localhost:5000/ctj/trainer"])
def test_an_image_without_a_tag_is_refused(image: str) -> None:
    with pytest.raises(ValueError, match="no tag"):
        st._repo_tag(image)


def _bare_stack() -> st.Stack:
    stack = st.Stack.__new__(st.Stack)
    stack.images = st.Images.from_env(IMAGES)
    return stack


def test_the_example_job_runs_our_trainer_image_with_the_given_env() -> None:
    job = _bare_stack().example_job(CTJ_TOTAL_STEPS="7", CTJ_NEW="x")
    original = yaml.safe_load(st.EXAMPLE_JOB.read_text())
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    assert trainer["image"] == "ctj/trainer:abc"
    assert trainer["imagePullPolicy"] == "IfNotPresent"
    env = {e["name"]: e["value"] for e in trainer["env"]}
    assert env["CTJ_TOTAL_STEPS"] == "7" and env["CTJ_NEW"] == "x"
    assert len(trainer["env"]) == len(env)  # replaced, not duplicated
    # everything else is the example's own, pointing at the in-cluster S3 server
    assert job["spec"]["checkpoint"] == original["spec"]["checkpoint"]
    assert job["spec"]["checkpoint"]["endpoint"] == st.S3_ENDPOINT
    assert (job["metadata"]["name"], job["spec"]["backend"]) == ("demo", "pods")
    kf = _bare_stack().example_job("demo-kf", "pytorchjob")
    assert (kf["metadata"]["name"], kf["spec"]["backend"]) == ("demo-kf", "pytorchjob")
    # examples/job-torchrun.yaml: the same script under torchrun, 2 ranks per pod
    two = _bare_stack().example_job("demo-2x", example="job-torchrun.yaml")
    assert two["spec"]["nprocPerNode"] == 2 and two["spec"]["checkpoint"] == original["spec"][
        "checkpoint"
    ] | {"stagingSizeLimit": "8Gi"}
    command = two["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command == ["torchrun", "examples/train_fsdp.py"]


def test_the_kubeflow_manifest_is_what_its_controller_expects() -> None:
    """deploy/kubeflow: names the controller's cert rotator uses (its defaults: Secret
    training-operator-webhook-cert, Service training-operator, the webhook configuration
    validator.training-operator.kubeflow.org), and an init container that needs no DNS
    tool the trainer image lacks."""
    objects = {o["kind"]: o for o in yaml.safe_load_all(st.KUBEFLOW_MANIFEST.read_text()) if o}
    assert objects["Secret"]["metadata"]["name"] == "training-operator-webhook-cert"
    (webhook,) = objects["ValidatingWebhookConfiguration"]["webhooks"]
    assert objects["ValidatingWebhookConfiguration"]["metadata"]["name"] == st.KUBEFLOW_WEBHOOK
    service = objects["Service"]["metadata"]
    assert webhook["clientConfig"]["service"]["name"] == service["name"] == "training-operator"
    assert service["namespace"] == st.KUBEFLOW_NAMESPACE
    assert webhook["rules"][0]["resources"] == ["pytorchjobs"]
    pod = objects["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    args = dict(a.split("=", 1) for a in container["args"])
    assert args["--enable-scheme"] == "pytorchjob"
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    template = args["--pytorch-init-container-template-file"]
    config_map = next(v for v in pod["volumes"] if v["name"] == mounts[template.rsplit("/", 1)[0]])
    assert config_map["configMap"]["name"] == objects["ConfigMap"]["metadata"]["name"]
    init = objects["ConfigMap"]["data"][template.rsplit("/", 1)[1]]
    assert "getent hosts {{.MasterAddr}}" in init and "nslookup" not in init
    assert mounts["/tmp/k8s-webhook-server/serving-certs"] == "cert"


def test_the_s3_manifest_serves_the_bucket_the_example_uses() -> None:
    objects = [o for o in yaml.safe_load_all(st.SEAWEEDFS_MANIFEST.read_text()) if o]
    server = next(o for o in objects if o["kind"] == "StatefulSet")
    args = server["spec"]["template"]["spec"]["containers"][0]["args"]
    # its data on a claim of its own, not an emptyDir: deleting the pod loses nothing
    mounts = server["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]
    claims = [c["metadata"]["name"] for c in server["spec"]["volumeClaimTemplates"]]
    assert {"name": "data", "mountPath": "/data"} in mounts and claims == ["data"]
    bucket = yaml.safe_load(st.EXAMPLE_JOB.read_text())["spec"]["checkpoint"]["uri"]
    assert f"-bucket={bucket.split('/')[2]}" in args
    service = next(o for o in objects if o["kind"] == "Service")
    name, ns = service["metadata"]["name"], service["metadata"]["namespace"]
    assert st.S3_ENDPOINT == f"http://{name}.{ns}:{service['spec']['ports'][0]['port']}"
    assert "secretKey" not in st.SEAWEEDFS_MANIFEST.read_text().split("kind:")[-1]


def test_credentials_are_random_and_never_in_their_repr() -> None:
    a, b = st.S3Credentials(), st.S3Credentials()
    assert a.access_key != b.access_key and a.secret_key != b.secret_key
    assert a.secret_key not in repr(a) and a.access_key not in repr(a)
    assert a.secret_key in a.identities_json()


def test_node_control_quotes_the_node_name(tmp_path: Path) -> None:
    out = tmp_path / "out"
    nodes = st.NodeControl(
        stop=f"echo stop {{node}} >> {out}", start=f"echo start {{node}} >> {out}"
    )
    nodes.stop_node("ctj-worker2; touch pwned")
    nodes.start_node("ctj-worker2")
    assert out.read_text().splitlines() == ["stop ctj-worker2; touch pwned", "start ctj-worker2"]
    assert not (Path.cwd() / "pwned").exists()
    with pytest.raises(subprocess.CalledProcessError):
        st.NodeControl(stop="false", start="true").stop_node("n")


def test_node_control_runs_a_command_on_a_node_quoted(tmp_path: Path) -> None:
    out = tmp_path / "out"
    nodes = st.NodeControl(stop="true", start="true", exec=f"echo {{node}} >> {out}; echo")
    nodes.run_on("ctj-worker2", "sh", "-c", "kill -s STOP 1; touch pwned")
    assert out.read_text().splitlines() == ["ctj-worker2"]
    assert not (Path.cwd() / "pwned").exists()
    with pytest.raises(RuntimeError, match="CTJ_E2E_NODE_EXEC"):
        st.NodeControl(stop="true", start="true").run_on("n", "true")


def test_node_control_needs_both_commands() -> None:
    assert st.NodeControl.from_env({"CTJ_E2E_NODE_STOP": "docker kill {node}"}) is None
    both = {"CTJ_E2E_NODE_STOP": "a {node}", "CTJ_E2E_NODE_START": "b {node}"}
    assert st.NodeControl.from_env(both) == st.NodeControl("a {node}", "b {node}")
    run = {**both, "CTJ_E2E_NODE_EXEC": "c {node}"}
    assert st.NodeControl.from_env(run) == st.NodeControl("a {node}", "b {node}", "c {node}")


def test_trainer_log_events_skip_other_lines_and_a_line_being_written() -> None:
    text = '\n'.join([
        '{"t": 1.0, "event": "restored", "step": 20}',
        "/app/examples/train_fsdp.py:114: UserWarning: ...",
        '{"t": 1.1, "event": "step", "step": 21}',
        '{"t": 1.2, "event": "st',
    ])  # fmt: skip
    assert trainer_log_events(text) == [
        {"t": 1.0, "event": "restored", "step": 20},
        {"t": 1.1, "event": "step", "step": 21},
    ]
