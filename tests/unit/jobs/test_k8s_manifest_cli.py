"""`regent k8s manifest`: every object it prints validates against the official Kubernetes 1.30 schemas
(`kubernetes-validate`, strict: unknown fields are errors), for CPU and GPU runs, in YAML and JSON; the job
secret never appears; bad input is refused with the flag and the fix."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from regent.cli import main
from regent.jobs.base import SECRET_ENV

kubernetes_validate = pytest.importorskip("kubernetes_validate")
yaml = pytest.importorskip("yaml")

K8S_VERSION = "1.30"
SECRET_VALUE = "5ec4e75ec4e75ec4e75ec4e75ec4e7aa"


def _validate(obj: dict[str, Any]) -> None:
    kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(["k8s", "manifest", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_the_validator_ships_1_30_and_rejects_a_broken_object() -> None:
    """The checks below mean something only if 1.30 schemas exist and a bad object fails them."""
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    assert (schemas / "v1.30.0-local-strict").is_dir()
    good = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"},
            "spec": {"clusterIP": "None", "ports": [{"port": 1}]}}
    _validate(good)
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate({**good, "spec": {**good["spec"], "clusterIp": "None"}})  # misspelt field: strict refuses


@pytest.mark.parametrize("variant,argv", [
    ("cpu", ["--replicas", "3"]),
    ("nvidia", ["--replicas", "2", "--gpus-per-pod", "8", "--procs-per-replica", "8", "--cpu", "96",
                "--memory", "1Ti", "--node-selector", "nvidia.com/gpu.product=H200"]),
    ("amd", ["--replicas", "2", "--hosts-per-replica", "2", "--gpus-per-pod", "8", "--gpu-resource", "amd.com/gpu",
             "--procs-per-replica", "16", "--namespace", "ml-team", "--name", "llm-run", "--port", "30000",
             "--service-account", "trainer", "--image-pull-secret", "regcred", "--image-pull-policy", "Always",
             "--host-network", "--shm-size", "64Gi"]),
])
def test_every_printed_object_validates_against_kubernetes_1_30(
    variant: str, argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SECRET_ENV, SECRET_VALUE)  # a controller secret in the environment must not leak out
    code, out, err = _run(["--image", "ghcr.io/acme/regent:0.1.0", *argv], capsys)
    assert code == 0, err
    docs = [d for d in yaml.safe_load_all(out) if d is not None]
    replicas = int(argv[argv.index("--replicas") + 1])
    assert [d["kind"] for d in docs] == ["Service", "Job"] * replicas
    for doc in docs:
        _validate(doc)
    assert SECRET_VALUE not in out and SECRET_VALUE not in err
    assert "kind: Secret" not in out
    name = argv[argv.index("--name") + 1] if "--name" in argv else "regent"
    assert f"create secret generic {name}-secret --from-file=secret=" in out  # the documented way, as a comment

    jobs = [d for d in docs if d["kind"] == "Job"]
    services = [d for d in docs if d["kind"] == "Service"]
    assert [j["metadata"]["name"] for j in jobs] == [f"{name}-replica-{i}" for i in range(replicas)]
    for job, service in zip(jobs, services):
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed" and spec["backoffLimit"] == 0
        assert service["spec"]["clusterIP"] == "None"
        pod = spec["template"]["spec"]
        assert pod["subdomain"] == service["metadata"]["name"]
        assert service["spec"]["selector"].items() <= spec["template"]["metadata"]["labels"].items()
        (volume,) = [v for v in pod["volumes"] if "secret" in v]
        assert volume["secret"]["secretName"] == f"{name}-secret"  # one Secret for the whole run
        limits = pod["containers"][0].get("resources", {}).get("limits", {})
        if variant == "cpu":
            assert "resources" not in pod["containers"][0]
        elif variant == "nvidia":
            assert limits == {"nvidia.com/gpu": "8", "cpu": "96", "memory": "1Ti"}
            assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "H200"}
        else:
            assert limits == {"amd.com/gpu": "8"} and spec["completions"] == 2 and pod["hostNetwork"] is True

    code, json_out, json_err = _run(["--image", "ghcr.io/acme/regent:0.1.0", *argv, "--output", "json"], capsys)
    assert code == 0
    listing = json.loads(json_out)
    # a v1 List (what `kubectl get -o json` prints; the schemas have none, its items were validated above)
    assert (listing["apiVersion"], listing["kind"]) == ("v1", "List") and listing["items"] == docs
    assert "--from-file=secret=" in json_err and SECRET_VALUE not in json_out


@pytest.mark.parametrize("argv,message", [
    (["--image", "x", "--replicas", "0"], "--replicas must be at least 1, not 0"),
    (["--image", "x", "--hosts-per-replica", "0"], "--hosts-per-replica must be at least 1"),
    (["--image", "x", "--gpus-per-pod", "-1"], "--gpus-per-pod must be 0"),
    (["--image", "x", "--gpus-per-pod", "1", "--gpu-resource", "intel.com/gpu"],
     "--gpu-resource 'intel.com/gpu' is not supported; use one of amd.com/gpu, nvidia.com/gpu"),
    (["--image", "x", "--gpu-resource", "nvidia.com/gpu"], "--gpu-resource needs --gpus-per-pod"),
    (["--image", "x", "--gpus-per-pod", "2", "--procs-per-replica", "4"], "needs one GPU per trainer process"),
    (["--replicas", "1"], "--image is required"),
    (["--image", "x", "--name", "Bad_Name"], "--name: job name 'Bad_Name' is not usable"),
    (["--image", "x", "--namespace", "ML"], "--namespace 'ML' is not a valid namespace name"),
    (["--image", "x", "--memory", "lots"], "--memory 'lots' is not a Kubernetes quantity"),
    (["--image", "x", "--port", "70000"], "--port must be a TCP port"),
    (["--image", "x", "--node-selector", "novalue"], "--node-selector 'novalue': expected KEY=VALUE"),
])
def test_bad_input_is_refused_with_the_fix(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(argv, capsys)
    assert code == 2 and out == ""
    assert message in err


@pytest.mark.parametrize("value", ["yes", "No", "on", "null", "~", "123", "1e3", "0o17", "a: b", "#x", "- x",
                                   "tcp://$(POD_IP):1", "", " lead", "quote\"d", "ünï", "true"])
def test_yaml_writer_round_trips_awkward_strings(value: str) -> None:
    from regent.jobs.k8s_manifest import to_yaml

    obj = {"apiVersion": "v1", "kind": "ConfigMap", "data": {value or "k": value, "list": [value, {"k": value}]},
           "n": [1, True, None, {}, []]}
    assert yaml.safe_load(to_yaml([obj])) == obj
