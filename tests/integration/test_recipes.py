"""The launch recipes under docs/recipes, checked offline: the Kubernetes
manifests parse and wire the job together, the sbatch script is valid bash."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

RECIPES = Path(__file__).resolve().parents[2] / "docs" / "recipes"


def load(name: str) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((RECIPES / name).read_text()))


def env_of(container: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_the_lighthouse_is_one_deployment_behind_a_service_on_its_grpc_port():
    deployment, service, claim = load("k8s-lighthouse.yaml")
    kinds = (deployment["kind"], service["kind"], claim["kind"])
    assert kinds == ("Deployment", "Service", "PersistentVolumeClaim")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"]["type"] == "Recreate"
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert "--bind=[::]:29510" in container["args"]
    assert "--secret-file=/etc/torchft/secret" in container["args"]
    assert {"name": "grpc", "port": 29510, "targetPort": "grpc"} in service["spec"]["ports"]
    # The state file lives on the claim, so a replacement pod keeps the job's mark.
    assert "--state-file=/var/lib/torchft/lighthouse.json" in container["args"]
    pod = deployment["spec"]["template"]["spec"]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/var/lib/torchft")
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]


def test_each_replica_group_pod_gets_its_index_the_service_its_ip_and_the_secret_file():
    (job,) = load("k8s-replica-groups.yaml")
    _, service, _ = load("k8s-lighthouse.yaml")
    spec = job["spec"]
    assert job["kind"] == "Job" and spec["completionMode"] == "Indexed"
    assert spec["completions"] == spec["parallelism"]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure"  # a dead group restarts and heals
    (container,) = pod["containers"]
    env = env_of(container)
    assert env["NUM_REPLICA_GROUPS"] == str(spec["completions"])
    assert env["REPLICA_GROUP_ID"] == {
        "fieldRef": {
            "fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"
        }
    }
    assert env["TORCHFT_HOSTNAME"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env["TORCHFT_LIGHTHOUSE"] == f"http://{service['metadata']['name']}:29510"
    mount = next(m for m in container["volumeMounts"] if m["name"] == "torchft-secret")
    assert env["TORCHFT_SECRET_FILE"] == mount["mountPath"] + "/secret"
    assert mount["readOnly"] is True
    volume = next(v for v in pod["volumes"] if v["name"] == "torchft-secret")
    assert volume["secret"]["secretName"] == "torchft-secret"
    assert not any("SECRET" in e and e != "TORCHFT_SECRET_FILE" for e in env), env


def test_the_sbatch_script_is_valid_bash():
    if shutil.which("bash") is None:
        pytest.skip("no bash to check the script with")
    script = RECIPES / "slurm_train.sbatch"
    result = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    text = script.read_text()
    assert "--rdzv-backend c10d" in text and "REPLICA_GROUP_ID=$group" in text
