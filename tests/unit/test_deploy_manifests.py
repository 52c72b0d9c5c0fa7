"""docker-compose.yml and deploy/k8s/*.yaml, validated without Docker or a cluster.

No Compose or Kubernetes JSON schema ships offline here, so this file holds minimal schemas of
the fields pdserve relies on (types, required keys, no unknown top-level keys) and then checks
what schemas cannot: references between objects (selectors match labels, HPAs and Services
target what exists, every pdserve container has health probes, compose services reference
defined anchors, profiles and health checks), and the security of both (issue 23): the
certificates and the Redis password come from Secrets / the certs volume, Redis requires the
password, NetworkPolicies let only the gateway reach the workers and only cluster members
reach Redis.
"""
from __future__ import annotations

import glob
import os

import jsonschema
import pytest
import yaml

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

_STR_LIST = {"type": "array", "items": {"type": "string"}}
_ENV = {"oneOf": [{"type": "object", "additionalProperties": {"type": ["string", "number",
                                                                       "boolean", "null"]}},
                  _STR_LIST]}
_HEALTH = {"type": "object", "required": ["test"], "additionalProperties": False, "properties": {
    "test": {"oneOf": [{"type": "string"}, _STR_LIST]},
    **{k: {"type": "string", "pattern": r"^\d+(ms|s|m)$"}
       for k in ("interval", "timeout", "start_period")},
    "retries": {"type": "integer", "minimum": 1}}}
_DEVICE = {"type": "object", "required": ["capabilities"], "properties": {
    "driver": {"type": "string"}, "count": {"oneOf": [{"type": "integer"}, {"const": "all"}]},
    "capabilities": _STR_LIST}}
_DEPLOY = {"type": "object", "additionalProperties": False, "properties": {
    "replicas": {"type": "integer"},
    "resources": {"type": "object", "properties": {"reservations": {"type": "object", "properties": {
        "devices": {"type": "array", "items": _DEVICE}}}}}}}
COMPOSE_SCHEMA = {
    "type": "object", "required": ["services"],
    "patternProperties": {"^x-": {}},
    "properties": {"name": {"type": "string"}, "services": {"type": "object"},
                   "volumes": {"type": "object"}, "networks": {"type": "object"}},
    "additionalProperties": False,
    "$defs": {"service": {
        "type": "object", "additionalProperties": False,
        "anyOf": [{"required": ["image"]}, {"required": ["build"]}],
        "properties": {
            "image": {"type": "string"},
            "build": {"type": "object", "required": ["context"], "additionalProperties": False,
                      "properties": {"context": {"type": "string"}, "args": {"type": "object"},
                                     "dockerfile": {"type": "string"}}},
            "command": {"oneOf": [{"type": "string"}, _STR_LIST]},
            "environment": _ENV,
            "ports": _STR_LIST, "expose": _STR_LIST, "volumes": _STR_LIST,
            "profiles": _STR_LIST, "networks": _STR_LIST, "user": {"type": "string"},
            "ipc": {"type": "string", "pattern": r"^(host|private|shareable|service:.+)$"},
            "restart": {"enum": ["no", "always", "on-failure", "unless-stopped"]},
            "healthcheck": _HEALTH,
            "depends_on": {"type": "object", "additionalProperties": {
                "type": "object", "required": ["condition"], "properties": {"condition": {
                    "enum": ["service_started", "service_healthy",
                             "service_completed_successfully"]}}}},
            "deploy": _DEPLOY}}},
}

_META = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
    "namespace": {"type": "string"}, "labels": {"type": "object",
                                                "additionalProperties": {"type": "string"}},
    "annotations": {"type": "object", "additionalProperties": {"type": "string"}}}}
_PROBE = {"type": "object", "minProperties": 1, "properties": {
    "grpc": {"type": "object", "required": ["port"], "properties": {
        "port": {"type": "integer"}, "service": {"type": "string"}}},
    "tcpSocket": {"type": "object", "required": ["port"]},
    "exec": {"type": "object", "required": ["command"]},
    **{k: {"type": "integer", "minimum": 1} for k in
       ("periodSeconds", "failureThreshold", "timeoutSeconds", "initialDelaySeconds")}}}
_QTY = {"type": ["string", "integer"], "pattern": r"^[0-9.]+(m|Ki|Mi|Gi|Ti)?$"}
_CONTAINER = {"type": "object", "required": ["name", "image"], "properties": {
    "name": {"type": "string"}, "image": {"type": "string"},
    "args": _STR_LIST, "command": _STR_LIST,
    "ports": {"type": "array", "items": {"type": "object", "required": ["containerPort"],
                                         "properties": {"containerPort": {"type": "integer"},
                                                        "name": {"type": "string",
                                                                 "maxLength": 15}}}},
    "env": {"type": "array", "items": {"type": "object", "required": ["name"]}},
    "volumeMounts": {"type": "array", "items": {"type": "object",
                                                "required": ["name", "mountPath"]}},
    "envFrom": {"type": "array"},
    "readinessProbe": _PROBE, "livenessProbe": _PROBE, "startupProbe": _PROBE,
    "resources": {"type": "object", "properties": {
        "requests": {"type": "object", "additionalProperties": _QTY},
        "limits": {"type": "object", "additionalProperties": _QTY}}}}}
K8S_SCHEMAS = {
    ("v1", "Namespace"): {},
    ("v1", "ConfigMap"): {"properties": {"data": {"type": "object", "additionalProperties": {
        "type": "string"}}}},
    ("apps/v1", "Deployment"): {"required": ["spec"], "properties": {"spec": {
        "type": "object", "required": ["selector", "template"], "properties": {
            "replicas": {"type": "integer", "minimum": 0},
            "selector": {"type": "object", "required": ["matchLabels"]},
            "template": {"type": "object", "required": ["metadata", "spec"], "properties": {
                "spec": {"type": "object", "required": ["containers"], "properties": {
                    "containers": {"type": "array", "minItems": 1, "items": _CONTAINER}}}}}}}}},
    ("v1", "Service"): {"required": ["spec"], "properties": {"spec": {
        "type": "object", "required": ["selector", "ports"], "properties": {
            "ports": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["port"]}}}}}},
    ("autoscaling/v2", "HorizontalPodAutoscaler"): {"required": ["spec"], "properties": {"spec": {
        "type": "object", "required": ["scaleTargetRef", "maxReplicas", "metrics"], "properties": {
            "scaleTargetRef": {"type": "object", "required": ["apiVersion", "kind", "name"]},
            "minReplicas": {"type": "integer", "minimum": 1},
            "maxReplicas": {"type": "integer", "minimum": 1},
            "metrics": {"type": "array", "minItems": 1, "items": {
                "type": "object", "required": ["type"], "properties": {
                    "type": {"enum": ["Resource", "Pods", "Object", "External",
                                      "ContainerResource"]}}}}}}}},
    ("kustomize.config.k8s.io/v1beta1", "Kustomization"): {"required": ["resources"]},
    ("networking.k8s.io/v1", "NetworkPolicy"): {"required": ["spec"], "properties": {"spec": {
        "type": "object", "required": ["podSelector", "policyTypes"], "properties": {
            "policyTypes": {"type": "array", "items": {"enum": ["Ingress", "Egress"]}},
            "ingress": {"type": "array", "items": {"type": "object", "properties": {
                "from": {"type": "array"}, "ports": {"type": "array", "items": {
                    "type": "object", "required": ["port"]}}}}}}}}},
}


def _compose():
    with open(os.path.join(REPO, "docker-compose.yml")) as f:
        return yaml.safe_load(f)


def _k8s_docs():
    docs = []
    for path in sorted(glob.glob(os.path.join(REPO, "deploy", "k8s", "*.yaml"))):
        with open(path) as f:
            docs += [(os.path.basename(path), d) for d in yaml.safe_load_all(f) if d]
    return docs


def test_compose_matches_schema():
    doc = _compose()
    jsonschema.validate(doc, COMPOSE_SCHEMA)
    service_schema = COMPOSE_SCHEMA["$defs"]["service"]
    for name, svc in doc["services"].items():
        jsonschema.validate(svc, service_schema)


def test_compose_services_fit_together():
    services = _compose()["services"]
    assert {"redis", "jaeger", "gateway", "prefill", "decode"} <= set(services)
    for role in ("gateway", "prefill", "decode"):
        cpu, gpu = services[role], services[f"{role}-gpu"]
        assert cpu["profiles"] == ["cpu"] and gpu["profiles"] == ["gpu"]
        for svc in (cpu, gpu):
            assert svc["command"][0] == role
            env = svc["environment"]
            assert env["OTEL_EXPORTER_OTLP_ENDPOINT"].startswith("http://jaeger:4317")
            assert env["OTEL_SERVICE_NAME"] == f"pdserve-{role}"
            assert env["PDSERVE_REDIS_URL"].startswith("redis://redis:")
            assert "@" not in env["PDSERVE_REDIS_URL"]  # no password in a URL
            assert svc["healthcheck"]["test"][1:4] == ["python", "-m", "services.healthcheck"]
            assert svc["healthcheck"]["test"][4].endswith(":" + svc["command"][2])
            assert ("--plaintext" in svc["healthcheck"]["test"]) == (role == "gateway")
            assert set(svc["depends_on"]) <= set(services)
        if role != "gateway":
            # scalable with --scale: no fixed host ports; the GPU ones reserve a device
            assert "ports" not in cpu and "ports" not in gpu
            dev = gpu["deploy"]["resources"]["reservations"]["devices"][0]
            assert dev["driver"] == "nvidia" and "gpu" in dev["capabilities"]
            assert gpu["environment"]["PDSERVE_DEVICE"] == "cuda"
            assert gpu["environment"]["PDSERVE_DTYPE"] == "bfloat16"
    assert services["gateway"]["environment"]["PDSERVE_MODEL"].endswith("smollm2-135m}")
    assert services["jaeger"]["environment"]["COLLECTOR_OTLP_ENABLED"] == "true"
    assert "16686:16686" in services["jaeger"]["ports"]
    assert os.path.exists(os.path.join(REPO, "Dockerfile"))


def test_compose_settings_are_real_flags():
    """Every PDSERVE_* variable in the compose file is a setting of the service it is given to."""
    from services.config import setting_names
    names = {"gateway": setting_names("gateway"), "worker": setting_names("worker")}
    for name, svc in _compose()["services"].items():
        kind = "gateway" if name.startswith("gateway") else "worker"
        for var in svc.get("environment", {}):
            if var.startswith("PDSERVE_") and name not in ("redis", "jaeger"):
                assert var[len("PDSERVE_"):].lower() in names[kind], (name, var)


def test_k8s_manifests_match_schemas():
    docs = _k8s_docs()
    assert docs
    for path, d in docs:
        key = (d.get("apiVersion"), d.get("kind"))
        assert key in K8S_SCHEMAS, (path, key)
        schema = {"type": "object", "required": ["apiVersion", "kind"], **K8S_SCHEMAS[key]}
        if key[1] != "Kustomization":
            schema["required"] = [*schema["required"], "metadata"]
            schema.setdefault("properties", {})["metadata"] = _META
        jsonschema.validate(d, schema)


@pytest.fixture(scope="module")
def k8s():
    objs = {}
    for _, d in _k8s_docs():
        objs[(d["kind"], d.get("metadata", {}).get("name"))] = d
    return objs


def test_k8s_objects_reference_each_other(k8s):
    deployments = {n: d for (k, n), d in k8s.items() if k == "Deployment"}
    assert {"pdserve-gateway", "pdserve-prefill", "pdserve-decode", "redis"} <= set(deployments)
    for name, dep in deployments.items():
        sel = dep["spec"]["selector"]["matchLabels"]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert sel.items() <= labels.items(), name
        for c in dep["spec"]["template"]["spec"]["containers"]:
            assert c.get("readinessProbe") and c.get("livenessProbe"), name
            assert c["resources"]["requests"] and c["resources"]["limits"], name
            if name.startswith("pdserve-"):
                grpc_port = next(p["containerPort"] for p in c["ports"] if p["name"] == "grpc")
                for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
                    # exec: the kubelet's gRPC probe cannot show a client certificate
                    # (the gateway's client port is plaintext: not an internal hop)
                    assert c[probe]["exec"]["command"] == [
                        "python", "-m", "services.healthcheck", f"127.0.0.1:{grpc_port}",
                        *(["--plaintext"] if name == "pdserve-gateway" else [])]
                assert "--port" in c["args"] and str(grpc_port) in c["args"]
                assert c["args"][0] == name.split("-", 1)[1]
                assert {"configMapRef": {"name": "pdserve-config"}} in c["envFrom"]
                assert ("ConfigMap", "pdserve-config") in k8s
    # independent pools: separate Deployments with their own replica counts
    assert "replicas" in deployments["pdserve-prefill"]["spec"]
    assert "replicas" in deployments["pdserve-decode"]["spec"]
    for (kind, name), svc in k8s.items():
        if kind != "Service":
            continue
        dep = deployments[name]
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert svc["spec"]["selector"].items() <= labels.items(), name
        port_names = {p["name"] for c in dep["spec"]["template"]["spec"]["containers"]
                      for p in c["ports"]}
        for p in svc["spec"]["ports"]:
            assert p.get("targetPort") in port_names or isinstance(p.get("targetPort"), int)
    redis_url = k8s[("ConfigMap", "pdserve-config")]["data"]["PDSERVE_REDIS_URL"]
    assert redis_url.startswith("redis://redis.") and ("Service", "redis") in k8s


def test_k8s_autoscaling(k8s):
    hpas = {n: d for (k, n), d in k8s.items() if k == "HorizontalPodAutoscaler"}
    for role in ("prefill", "decode"):
        hpa = hpas[f"pdserve-{role}"]
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) in k8s and ref["apiVersion"] == "apps/v1"
        metric = hpa["spec"]["metrics"][0]
        assert metric["type"] == "Pods"
        assert metric["pods"]["metric"]["name"] == "pdserve_queue_depth"
        assert metric["pods"]["target"]["type"] == "AverageValue"
    for hpa in hpas.values():
        ref = hpa["spec"]["scaleTargetRef"]
        assert (ref["kind"], ref["name"]) in k8s
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]


def test_kustomization_lists_every_manifest():
    with open(os.path.join(REPO, "deploy", "k8s", "kustomization.yaml")) as f:
        listed = set(yaml.safe_load(f)["resources"])
    files = {os.path.basename(p) for p in glob.glob(os.path.join(REPO, "deploy", "k8s", "*.yaml"))}
    assert listed == files - {"kustomization.yaml"}


def test_queue_depth_metric_exists():
    """The HPA's metric is one the workers export."""
    from services.metrics import WorkerMetrics
    names = {m.name for m in WorkerMetrics("decode").registry.collect()}
    assert "pdserve_queue_depth" in names


def test_schemas_reject_mistakes():
    svc = {"image": "pdserve:cpu", "comand": ["gateway"]}  # typo
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(svc, COMPOSE_SCHEMA["$defs"]["service"])
    dep = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"},
           "spec": {"selector": {"matchLabels": {"a": "b"}}, "template": {
               "metadata": {}, "spec": {"containers": [{"name": "c"}]}}}}  # no image
    schema = {"type": "object", **K8S_SCHEMAS[("apps/v1", "Deployment")]}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(dep, schema)


def test_gpu_workers_use_a_gpu_kv_backend_with_multicast_off():
    """tcp / shm need a CPU cache: a GPU worker configured with them would not start."""
    with open(os.path.join(REPO, "docker-compose.yml")) as f:
        services = yaml.safe_load(f)["services"]
    gpu_workers = [s for n, s in services.items() if n in ("prefill-gpu", "decode-gpu")]
    assert len(gpu_workers) == 2
    for svc in gpu_workers:
        env = svc["environment"]
        assert env["PDSERVE_KV_BACKEND"].split(",")[0] in ("nccl", "cuda_ipc", "nixl")
        assert env["NCCL_NVLS_ENABLE"] == "0" and env["NVSHMEM_DISABLE_NVLS"] == "1"


# ----------------------------------------------------------------------- security (issue 23)
def _pod(dep):
    return dep["spec"]["template"]["spec"]


def test_k8s_identity_and_redis_password_come_from_secrets(k8s):
    with open(os.path.join(REPO, "deploy", "k8s", "kustomization.yaml")) as f:
        kust = yaml.safe_load(f)
    generated = {g["name"]: g for g in kust["secretGenerator"]}
    assert kust["generatorOptions"]["disableNameSuffixHash"] is True  # rotation in place
    config = k8s[("ConfigMap", "pdserve-config")]["data"]
    mounts = {}
    for role in ("gateway", "prefill", "decode"):
        dep = k8s[("Deployment", f"pdserve-{role}")]
        vols = {v["name"]: v for v in _pod(dep)["volumes"]}
        secret = vols["tls"]["secret"]["secretName"]
        assert secret == f"pdserve-{role}-tls" and secret in generated
        files = dict(f.split("=", 1) for f in generated[secret]["files"])
        assert files == {"ca.crt": "secrets/ca.crt", "tls.crt": f"secrets/{role}.crt",
                         "tls.key": f"secrets/{role}.key"}
        assert vols["redis-password"]["secret"]["secretName"] == "pdserve-redis"
        c = _pod(dep)["containers"][0]
        mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
        assert all(m.get("readOnly") for m in c["volumeMounts"])
        assert vols["tls"]["secret"]["defaultMode"] & 0o007 == 0  # not world-readable
    assert config["PDSERVE_TLS_CERT_FILE"] == mounts["tls"] + "/tls.crt"
    assert config["PDSERVE_TLS_KEY_FILE"] == mounts["tls"] + "/tls.key"
    assert config["PDSERVE_TLS_CA_FILE"] == mounts["tls"] + "/ca.crt"
    assert config["PDSERVE_REDIS_PASSWORD_FILE"] == mounts["redis-password"] + "/password"
    assert "@" not in config["PDSERVE_REDIS_URL"]
    assert not any("PASSWORD=" in v or "api_key" in v.lower() for v in config.values())
    # every PDSERVE_ variable of the ConfigMap is a setting of the services
    from services.config import setting_names
    names = setting_names("worker") | setting_names("gateway")
    for var in config:
        if var.startswith("PDSERVE_"):
            assert var[len("PDSERVE_"):].lower() in names, var
    # Redis: the password from the Secret's redis.conf, its probe authenticates
    redis = _pod(k8s[("Deployment", "redis")])
    rc = redis["containers"][0]
    assert rc["args"][0] == "/etc/redis/redis.conf"
    assert not any("requirepass" in a for a in rc["args"])
    assert {v["name"]: v["secret"]["secretName"] for v in redis["volumes"]} == {
        "redis-conf": "pdserve-redis"}
    assert "REDISCLI_AUTH" in " ".join(rc["livenessProbe"]["exec"]["command"])
    assert set(dict(f.split("=", 1) for f in generated["pdserve-redis"]["files"])) == {
        "password", "redis.conf"}


def _allowed_from(policy, port):
    """The app names a policy admits on ``port`` (None: anyone)."""
    out = set()
    for rule in policy["spec"].get("ingress", []):
        if port not in [p["port"] for p in rule.get("ports", [])]:
            continue
        if "from" not in rule:
            return None
        for peer in rule["from"]:
            if "podSelector" in peer and "namespaceSelector" not in peer:
                out.add(peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"])
            else:
                out.add("ns:" + peer["namespaceSelector"]["matchLabels"][
                    "kubernetes.io/metadata.name"])
    return out


def test_k8s_network_policies(k8s):
    policies = {n: d for (k, n), d in k8s.items() if k == "NetworkPolicy"}
    deny = policies["default-deny-ingress"]["spec"]
    assert deny["podSelector"] == {} and deny["policyTypes"] == ["Ingress"]
    assert "ingress" not in deny
    by_app = {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"]: p
              for n, p in policies.items() if n != "default-deny-ingress"}
    assert set(by_app) == {"pdserve-gateway", "pdserve-prefill", "pdserve-decode", "redis"}
    assert _allowed_from(by_app["pdserve-gateway"], 50051) is None  # the front door
    assert _allowed_from(by_app["pdserve-decode"], 50061) == {"pdserve-gateway"}
    assert _allowed_from(by_app["pdserve-prefill"], 50061) == {"pdserve-gateway",
                                                               "pdserve-decode"}
    assert _allowed_from(by_app["pdserve-decode"], 50071) == {"pdserve-prefill"}
    assert _allowed_from(by_app["redis"], 6379) == {"pdserve-gateway", "pdserve-prefill",
                                                    "pdserve-decode"}
    for app in ("pdserve-gateway", "pdserve-prefill", "pdserve-decode"):
        assert _allowed_from(by_app[app], 9100) == {"ns:monitoring"}
    # the ports the policies open are the ones the pods listen on
    for app, port in (("pdserve-decode", 50071), ("pdserve-prefill", 50061)):
        c = _pod(k8s[("Deployment", app)])["containers"][0]
        assert port in [p["containerPort"] for p in c["ports"]]


def test_compose_identity_and_redis_password():
    services = _compose()["services"]
    certs = services["certs"]
    assert certs["command"][:3] == ["certs", "--out", "/certs"] and "--keep" in certs["command"]
    assert "pdserve-certs:/certs" in certs["volumes"]
    redis = services["redis"]
    assert redis["command"][:2] == ["redis-server", "/certs/redis.conf"]
    assert not any("requirepass" in a for a in redis["command"])
    assert redis["networks"] == ["internal"] and "ports" not in redis
    assert "REDISCLI_AUTH" in redis["healthcheck"]["test"][1]
    assert _compose()["networks"]["internal"]["internal"] is True
    for role in ("gateway", "prefill", "decode"):
        for name in (role, f"{role}-gpu"):
            svc = services[name]
            env = svc["environment"]
            assert env["PDSERVE_TLS_CERT_FILE"] == f"/certs/{role}.crt"
            assert env["PDSERVE_TLS_KEY_FILE"] == f"/certs/{role}.key"
            assert env["PDSERVE_TLS_CA_FILE"] == "/certs/ca.crt"
            assert env["PDSERVE_REDIS_PASSWORD_FILE"] == "/certs/redis-password"
            assert "pdserve-certs:/certs:ro" in svc["volumes"]
            assert svc["depends_on"]["certs"]["condition"] == \
                "service_completed_successfully"
            assert "--insecure" not in svc["command"]


def test_pdserve_certs_writes_what_the_deployments_mount(tmp_path):
    """The files compose and the kustomization name are the ones ``pdserve certs`` makes,
    and they make a working identity per role."""
    import subprocess
    import sys
    from services.tls import ClusterTls
    out = tmp_path / "secrets"
    subprocess.run([sys.executable, "-m", "pdserve.cli", "certs", "--out", str(out)],
                   check=True, cwd=REPO, capture_output=True, timeout=60)
    with open(os.path.join(REPO, "deploy", "k8s", "kustomization.yaml")) as f:
        kust = yaml.safe_load(f)
    for g in kust["secretGenerator"]:
        for item in g["files"]:
            assert (out / item.split("=", 1)[1].removeprefix("secrets/")).exists(), item
    for role in ("gateway", "prefill", "decode"):
        assert ClusterTls(str(out / "ca.crt"), str(out / f"{role}.crt"),
                          str(out / f"{role}.key")).role == role
    password = (out / "redis-password").read_text().strip()
    assert (out / "redis.conf").read_text() == f"requirepass {password}\n"
    assert oct((out / "gateway.key").stat().st_mode & 0o777) == "0o600"
