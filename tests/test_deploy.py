"""The Kubernetes manifests and the container image recipe (issue 15, part 5), checked offline.

Every object under deploy/kubernetes is validated against the Kubernetes OpenAPI schemas (the pinned set that
ships in the `kubernetes-validate` package, strict: unknown fields are errors); the InferencePool against the
v1 schema of the Gateway API Inference Extension's CRD (tests/k8s_schemas, pinned to GIE v1.6.0), made strict
the same way. Then the pieces must fit: selectors, ports, probe paths, the HPA's target, and every server
flag the Deployment passes must be one `novainfer serve` knows.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
MANIFESTS = REPO / "deploy" / "kubernetes"
KUBERNETES_VERSION = "1.33"
CRD_SCHEMAS = {("inference.networking.k8s.io/v1", "InferencePool"):
               Path(__file__).parent / "k8s_schemas" / "inferencepool-v1.json"}


def documents() -> list[tuple[str, dict]]:
    out = []
    for path in sorted(MANIFESTS.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            if doc:
                out.append((path.name, doc))
    return out


def strict(schema):
    """A CRD schema with unknown fields refused (the API server would silently prune them)."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if "properties" in schema and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


def by_kind(kind: str, name: str | None = None) -> dict:
    found = [d for _, d in documents() if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, (kind, name, len(found))
    return found[0]


@pytest.mark.parametrize("name,doc", documents(), ids=lambda v: v if isinstance(v, str) else v["kind"])
def test_each_object_matches_its_schema(name, doc):
    crd = CRD_SCHEMAS.get((doc["apiVersion"], doc["kind"]))
    if crd is not None:
        schema = strict(json.loads(crd.read_text()))
        schema["properties"]["metadata"] = {"type": "object", "required": ["name"]}
        jsonschema.validate(doc, schema)
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_the_validators_refuse_a_typo():
    deployment = json.loads(json.dumps(by_kind("Deployment")))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSION, strict=True)
    pool = json.loads(json.dumps(by_kind("InferencePool")))
    pool["spec"]["targetPort"] = 8000
    schema = strict(json.loads(CRD_SCHEMAS[("inference.networking.k8s.io/v1", "InferencePool")].read_text()))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(pool, schema)


def test_kustomization_lists_every_manifest():
    listed = set(yaml.safe_load((MANIFESTS / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in MANIFESTS.glob("*.yaml")} - {"kustomization.yaml"}


def test_the_pieces_fit():
    deployment = by_kind("Deployment")
    pod = deployment["spec"]["template"]
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    container = pod["spec"]["containers"][0]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    for probe, path in [("startupProbe", "/health"), ("livenessProbe", "/health"), ("readinessProbe", "/ready")]:
        assert container[probe]["httpGet"] == {"path": path, "port": "http"}, probe
    for service in (d for _, d in documents() if d["kind"] == "Service"):
        assert service["spec"]["selector"].items() <= labels.items()
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in ports
    hpa = by_kind("HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "vllm_num_requests_waiting"
    rules = yaml.safe_load(by_kind("ConfigMap")["data"]["config.yaml"])["rules"]
    assert any(r["name"]["as"] == "vllm_num_requests_waiting" and "vllm:num_requests_waiting" in r["seriesQuery"]
               for r in rules)
    pool = by_kind("InferencePool")
    assert pool["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [ports["http"]]
    # The drain must fit in the grace period Kubernetes gives before SIGKILL.
    grace = next(int(a.split("=")[1]) for a in container["args"] if a.startswith("--shutdown-grace="))
    assert grace < pod["spec"]["terminationGracePeriodSeconds"]


def test_the_server_knows_every_flag_the_deployment_passes():
    container = by_kind("Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["args"][0] == "serve"
    flags = [a.split("=", 1) for a in container["args"][1:]]
    help_text = subprocess.run([sys.executable, "-m", "novainfer.server", "--help"], capture_output=True,
                               text=True, timeout=60, check=True).stdout
    for flag, _ in flags:
        assert re.search(rf"^\s+(?:-\w, )?{re.escape(flag)}\b", help_text, re.M), f"{flag} is not a server option"
    config = dict(flags)["--kv-events-config"]
    parsed = json.loads(config.replace("$(POD_NAME)", "pod-0"))
    assert parsed["enable_kv_cache_events"] and parsed["endpoint"] == "tcp://*:5557"
    init = by_kind("Deployment")["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"][:2] == ["novainfer", "fetch"]


def test_the_image_serves_on_all_interfaces_and_exposes_the_ports():
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(r"^EXPOSE 8000 5557 5558$", dockerfile, re.M)
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", dockerfile, re.M).group(1))
    assert cmd[:3] == ["serve", "--host", "0.0.0.0"]
    assert "target" in (REPO / ".dockerignore").read_text().split()
