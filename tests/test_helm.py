"""The Helm chart helm/otel-gpu, rendered by Helm's own engine (helm-python-sdk bundles Helm's Go library), each
manifest validated against the Kubernetes 1.30 schemas (kubernetes-validate, strict: unknown fields fail), and each
rendered collector config loaded by otel-gpu's own config validator.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the test extra: pip install -e '.[test]'")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from layout import source_files  # noqa: E402
from otel_gpu.collector.config import load_text  # noqa: E402

CHART = Path(__file__).resolve().parents[1] / "helm" / "otel-gpu"
KUBE = "1.30"
NAMESPACE = "gpu-observability"
RELEASE = "og"

FULL_VALUES: dict[str, Any] = {
    "image": {"tag": "9.9.9"},
    "backend": {"otlp": {"endpoint": "tempo-distributor.tracing.svc:4317"}},
    "aggregator": {"enabled": True, "replicas": 2, "persistence": {"enabled": True, "size": "5Gi"},
                   "resources": {"requests": {"cpu": "300m", "memory": "300Mi"},
                                 "limits": {"cpu": "2", "memory": "2Gi"}},
                   "security": {"tokenSecret": "aggregator-token"}},
    "trustedForwarders": {"tokenSecret": "forwarder-token"},
    "serviceMonitor": {"enabled": True, "interval": "5s", "scrapeTimeout": "4s", "labels": {"release": "kps"}},
    "agent": {
        "receivers": {"xid": {"enabled": True}},
        "hostPorts": {"enabled": True},
        "resources": {"requests": {"cpu": "123m", "memory": "77Mi"}, "limits": {"cpu": "1", "memory": "333Mi"}},
        "store": {"hostPath": "/var/lib/otel-gpu"},
        "nodeSelector": {"nvidia.com/gpu.present": "true"},
        "extraEnv": [{"name": "OTEL_GPU_EXTRA", "value": "1"}],
        "security": {"tokenSecret": "agent-token"},
    },
    "nvidia": {"runtimeClassName": "nvidia"},
    "trainingEnv": {"namespaces": ["team-a", "team-b"], "extra": {"OTEL_GPU_STACK_AFTER_S": 30}},
    "commonLabels": {"team": "ml-infra"},
}

XID_FILE_VALUES: dict[str, Any] = {
    "agent": {"receivers": {"xid": {"enabled": True, "source": "file", "file": {"path": "/var/log/kern.log"}}}},
}

AGGREGATOR_ONLY_VALUES: dict[str, Any] = {"agent": {"enabled": False},
                                          "aggregator": {"enabled": True, "security": {"tokenSecret": "agg-token"}}}

VALUE_SETS = {"default": {}, "full": FULL_VALUES, "xid-file": XID_FILE_VALUES, "aggregator-only": AGGREGATOR_ONLY_VALUES}


def render(values: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """Renders the chart as `helm template` would; returns the manifests and NOTES.txt."""
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(copy.deepcopy(values), name=RELEASE, namespace=NAMESPACE)
    manifests: list[dict[str, Any]] = []
    notes = ""
    for path, text in sorted(out.items()):
        if path.endswith("NOTES.txt"):
            notes = text
            continue
        for doc in yaml.safe_load_all(text):
            if doc:
                doc["__template__"] = path
                manifests.append(doc)
    return manifests, notes


def find(manifests: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [m for m in manifests if m["kind"] == kind and (name is None or m["metadata"]["name"] == name)]


def one(manifests: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(manifests, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[m['metadata']['name'] for m in found]}"
    return found[0]


def container_port(container: dict, name: str) -> int:
    return next(p["containerPort"] for p in container["ports"] if p["name"] == name)


def endpoint_port(endpoint: str) -> int:
    return int(endpoint.rsplit(":", 1)[1])


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request) -> tuple[str, list[dict], str]:
    manifests, notes = render(VALUE_SETS[request.param])
    return request.param, manifests, notes


def test_lint_is_clean_in_strict_mode_for_every_value_set():
    for label, values in VALUE_SETS.items():
        result = helm.lint(str(CHART), copy.deepcopy(values), kube_version="v1.30.0", strict=True)
        problems = [m for m in result["messages"] if m["severity"] >= 2]  # 1 info, 2 warning, 3 error
        assert not result["errors"] and not problems, f"{label}: {result}"


def test_every_manifest_is_valid_kubernetes(rendered):
    label, manifests, _ = rendered
    assert manifests
    for m in manifests:
        doc = {k: v for k, v in m.items() if k != "__template__"}
        if m["kind"] == "ServiceMonitor":
            continue  # a CRD: its shape is checked in test_service_monitor_selects_the_metrics_ports
        kubernetes_validate.validate(doc, KUBE, strict=True)
        assert m["metadata"]["labels"]["app.kubernetes.io/instance"] == RELEASE, m["__template__"]


def test_strict_validation_can_fail():
    """The validator is not a rubber stamp: a misspelt field is refused."""
    manifests, _ = render({})
    ds = copy.deepcopy(one(manifests, "DaemonSet"))
    del ds["__template__"]
    ds["spec"]["template"]["spec"]["containers"][0]["readinessProbes"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, KUBE, strict=True)


def test_rendered_collector_configs_load_with_our_validator(rendered, monkeypatch):
    label, manifests, _ = rendered
    monkeypatch.setenv("NODE_NAME", "gpu-node-7")  # the DaemonSet sets it from spec.nodeName
    configs = [m for m in find(manifests, "ConfigMap") if "config.yaml" in m.get("data", {})]
    expected = {"default": 1, "full": 2, "xid-file": 1, "aggregator-only": 1}[label]
    assert len(configs) == expected
    for cm in configs:
        cfg = load_text(cm["data"]["config.yaml"], f"{label}:{cm['metadata']['name']}")
        assert {p.signal.value for p in cfg.pipelines} == {"traces", "metrics", "logs"}
        for spec in cfg.components.values():
            if spec.type in ("nvml", "nic", "xid"):
                assert spec.config.host_name == "gpu-node-7"  # the node's name, not the pod's
            if spec.type == "nic":
                assert spec.config.sysfs_root == "/host/sys"


def _agent_config(manifests: list[dict]) -> dict:
    return yaml.safe_load(one(manifests, "ConfigMap", f"{RELEASE}-otel-gpu-agent")["data"]["config.yaml"])


def test_default_agent_is_least_privilege():
    manifests, _ = render({})
    ds = one(manifests, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    sc = container["securityContext"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert "privileged" not in sc
    assert pod["automountServiceAccountToken"] is False
    assert not pod.get("hostNetwork") and not pod.get("hostPID")
    host_paths = {v["name"]: v["hostPath"]["path"] for v in pod["volumes"] if "hostPath" in v}
    assert host_paths == {"sys": "/sys"}  # no kernel log access unless the xid receiver is on
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    assert mounts["sys"]["readOnly"] is True and mounts["config"]["readOnly"] is True
    assert all("hostPort" not in p for p in container["ports"])
    # The agent must never take a GPU away from training pods.
    assert "nvidia.com/gpu" not in str(container["resources"])
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all" and env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert "xid" not in _agent_config(manifests)["receivers"]
    assert not find(manifests, "Deployment") and not find(manifests, "ServiceMonitor")


def test_xid_from_kmsg_is_the_one_privileged_mode():
    manifests, notes = render({"agent": {"receivers": {"xid": {"enabled": True, "source": "kmsg"}}}})
    pod = one(manifests, "DaemonSet")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"]["privileged"] is True
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    kmsg = next(v for v in pod["volumes"] if v["name"] == "kmsg")
    assert kmsg["hostPath"] == {"path": "/dev/kmsg", "type": "CharDevice"}
    assert {"name": "kmsg", "mountPath": "/dev/kmsg", "readOnly": True} in container["volumeMounts"]
    cfg = _agent_config(manifests)
    assert cfg["receivers"]["xid"]["path"] == "/dev/kmsg"
    assert "xid" in cfg["service"]["pipelines"]["logs"]["receivers"]
    assert "runs privileged" in notes


def test_xid_from_a_file_stays_non_root():
    manifests, _ = render(XID_FILE_VALUES)
    pod = one(manifests, "DaemonSet")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "privileged" not in container["securityContext"]
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["supplementalGroups"] == [4]
    vol = next(v for v in pod["volumes"] if v["name"] == "kernlog")
    assert vol["hostPath"] == {"path": "/var/log/kern.log", "type": "File"}
    mount = next(m for m in container["volumeMounts"] if m["name"] == "kernlog")
    assert mount["readOnly"] is True
    assert _agent_config(manifests)["receivers"]["xid"]["path"] == mount["mountPath"]


def test_ports_probes_and_config_agree(rendered):
    """Probes hit the Prometheus exporter's /health on the port the rendered config makes it listen on; the OTLP
    ports of the container, the Service and the config are the same numbers."""
    label, manifests, _ = rendered
    workloads = find(manifests, "DaemonSet") + find(manifests, "Deployment")
    assert workloads
    for w in workloads:
        pod = w["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        cm_name = next(v["configMap"]["name"] for v in pod["volumes"] if v["name"] == "config")
        cfg = yaml.safe_load(one(manifests, "ConfigMap", cm_name)["data"]["config.yaml"])
        assert container["args"] == ["collector", "--config", "/etc/otel-gpu/config.yaml"]
        metrics_port = container_port(container, "metrics")
        assert endpoint_port(cfg["exporters"]["prometheus"]["endpoint"]) == metrics_port
        assert endpoint_port(cfg["receivers"]["otlp"]["grpc"]["endpoint"]) == container_port(container, "otlp-grpc")
        assert endpoint_port(cfg["receivers"]["otlp"]["http"]["endpoint"]) == container_port(container, "otlp-http")
        for probe in ("livenessProbe", "readinessProbe"):
            assert container[probe]["httpGet"] == {"path": "/health", "port": "metrics"}
        assert container["resources"]["requests"] and container["resources"]["limits"]
        # The pod restarts when its config changes.
        assert len(w["spec"]["template"]["metadata"]["annotations"]["checksum/config"]) == 64
        mounts = {m["mountPath"] for m in container["volumeMounts"]}
        assert {"/etc/otel-gpu", "/var/lib/otel-gpu", "/tmp"} <= mounts
        assert cfg["exporters"]["store"]["path"] == "/var/lib/otel-gpu"
        for svc in find(manifests, "Service"):
            if svc["spec"]["selector"] == w["spec"]["selector"]["matchLabels"]:
                names = {p["name"] for p in container["ports"]}
                assert {p["targetPort"] for p in svc["spec"]["ports"]} <= names


def test_full_values_reach_the_manifests():
    manifests, notes = render(FULL_VALUES)
    ds = one(manifests, "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "ghcr.io/otel-gpu/otel-gpu:9.9.9"
    assert container["resources"] == FULL_VALUES["agent"]["resources"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"name": "OTEL_GPU_EXTRA", "value": "1"} in container["env"]
    assert next(p for p in container["ports"] if p["name"] == "otlp-grpc")["hostPort"] == 4317
    assert next(v for v in pod["volumes"] if v["name"] == "data")["hostPath"]["path"] == "/var/lib/otel-gpu"
    assert ds["metadata"]["labels"]["team"] == "ml-infra"

    agg = one(manifests, "Deployment")
    assert agg["spec"]["replicas"] == 2 and agg["spec"]["strategy"] == {"type": "Recreate"}
    (agg_container,) = agg["spec"]["template"]["spec"]["containers"]
    assert agg_container["resources"] == FULL_VALUES["aggregator"]["resources"]
    pvc = one(manifests, "PersistentVolumeClaim")
    assert pvc["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert next(v for v in agg["spec"]["template"]["spec"]["volumes"] if v["name"] == "data")[
        "persistentVolumeClaim"]["claimName"] == pvc["metadata"]["name"]

    # Agents forward everything to the aggregator's Service; traces reach the backend through the aggregator,
    # which adds the failure.* attributes.
    agent_cfg = _agent_config(manifests)
    agg_svc = one(manifests, "Service", f"{RELEASE}-otel-gpu-aggregator")
    host, port = agent_cfg["exporters"]["otlp/aggregator"]["endpoint"].rsplit(":", 1)
    assert host == f"{agg_svc['metadata']['name']}.{NAMESPACE}.svc"
    assert int(port) == next(p["port"] for p in agg_svc["spec"]["ports"] if p["name"] == "otlp-grpc")
    for signal in ("traces", "metrics", "logs"):
        assert "otlp/aggregator" in agent_cfg["service"]["pipelines"][signal]["exporters"]
    assert "otlp/backend" not in agent_cfg["exporters"]
    agg_cfg = yaml.safe_load(one(manifests, "ConfigMap", f"{RELEASE}-otel-gpu-aggregator")["data"]["config.yaml"])
    assert agg_cfg["exporters"]["otlp/backend"]["endpoint"] == "tempo-distributor.tracing.svc:4317"
    assert "otlp/backend" in agg_cfg["service"]["pipelines"]["traces"]["exporters"]
    assert "Aggregator: Deployment" in notes and "status.hostIP" in notes


def test_backend_without_aggregator_is_fed_by_the_agent():
    manifests, _ = render({"backend": {"otlp": {"endpoint": "jaeger-collector.tracing.svc:4317",
                                                "settings": {"timeout": "5s"}}}})
    cfg = _agent_config(manifests)
    assert cfg["exporters"]["otlp/backend"] == {"endpoint": "jaeger-collector.tracing.svc:4317", "timeout": "5s"}
    assert cfg["service"]["pipelines"]["traces"]["exporters"] == ["store", "otlp/backend"]


def test_agent_config_overlay_merges_maps_and_replaces_lists():
    manifests, _ = render({"agent": {"config": {"receivers": {"nvml": {"interval": "2s"}},
                                                "service": {"telemetry": {"logs": {"level": "debug"}}}}}})
    cfg = _agent_config(manifests)
    assert cfg["receivers"]["nvml"] == {"interval": "2s", "host_name": "${env:NODE_NAME}"}
    assert cfg["receivers"]["otlp"]["grpc"]["endpoint"] == "0.0.0.0:4317"  # untouched keys stay
    assert cfg["service"]["telemetry"]["logs"]["level"] == "debug"
    assert cfg["service"]["pipelines"]["metrics"]["exporters"] == ["prometheus", "store"]


def test_agent_service_keeps_traffic_on_the_node_and_training_env_points_at_it():
    manifests, notes = render(FULL_VALUES)
    svc = one(manifests, "Service", f"{RELEASE}-otel-gpu-agent")
    assert svc["spec"]["internalTrafficPolicy"] == "Local"
    grpc_port = next(p["port"] for p in svc["spec"]["ports"] if p["name"] == "otlp-grpc")
    envs = find(manifests, "ConfigMap", f"{RELEASE}-otel-gpu-training-env")
    assert sorted(m["metadata"]["namespace"] for m in envs) == sorted([NAMESPACE, "team-a", "team-b"])
    for env in envs:
        assert env["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"] == f"http://{RELEASE}-otel-gpu-agent.{NAMESPACE}.svc:{grpc_port}"
        assert env["data"]["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
        assert env["data"]["OTEL_GPU_STACK_AFTER_S"] == "30"
    for needle in (f"{RELEASE}-otel-gpu-training-env", "OTEL_GPU_JOB_ID", "OTEL_SERVICE_NAME", "otel-gpu run"):
        assert needle in notes
    http = render({"trainingEnv": {"protocol": "http/protobuf"}})[0]
    env = one(http, "ConfigMap", f"{RELEASE}-otel-gpu-training-env")
    assert env["data"]["OTEL_EXPORTER_OTLP_ENDPOINT"].endswith(":4318")


def test_service_monitor_selects_the_metrics_ports():
    manifests, _ = render(FULL_VALUES)
    sm = one(manifests, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["release"] == "kps"
    spec = sm["spec"]
    assert set(spec) == {"selector", "namespaceSelector", "endpoints"}
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (ep,) = spec["endpoints"]
    assert ep["port"] == "metrics" and ep["path"] == "/metrics"
    assert ep["interval"] == "5s" and ep["scrapeTimeout"] == "4s"
    selected = [s for s in find(manifests, "Service")
                if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    assert {s["metadata"]["name"] for s in selected} == {f"{RELEASE}-otel-gpu-agent", f"{RELEASE}-otel-gpu-aggregator"}
    for s in selected:
        assert any(p["name"] == "metrics" for p in s["spec"]["ports"])


def test_bad_values_are_refused_by_the_schema():
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError, match="portz"):
            chart.render({"agent": {"portz": 1}}, name=RELEASE, namespace=NAMESPACE)
        with pytest.raises(helm.HelmError, match="source"):
            chart.render({"agent": {"receivers": {"xid": {"enabled": True, "source": "journal"}}}},
                         name=RELEASE, namespace=NAMESPACE)


# -- works as shipped: attribution and goodput, processors, environment, schema ----------------------------------------
def _configs(manifests: list[dict]) -> dict[str, dict]:
    return {cm["metadata"]["name"]: yaml.safe_load(cm["data"]["config.yaml"])
            for cm in find(manifests, "ConfigMap") if "config.yaml" in cm.get("data", {})}


def test_default_agent_runs_attribution_and_goodput(monkeypatch):
    """Installed as it is, the agent analyzes: otel-gpu report has failures and goodput to show."""
    monkeypatch.setenv("NODE_NAME", "gpu-node-1")
    manifests, notes = render({})
    cfg = _agent_config(manifests)
    for signal in ("traces", "metrics", "logs"):
        assert cfg["service"]["pipelines"][signal]["processors"] == ["memory_limiter", "attribution", "goodput"]
    assert cfg["processors"]["attribution"] == {} and cfg["processors"]["goodput"] == {}
    loaded = load_text(yaml.safe_dump(cfg), "default agent")
    assert {spec.type for spec in loaded.components.values()} >= {"memory_limiter", "attribution", "goodput"}
    assert "otel-gpu report --store /var/lib/otel-gpu" in notes and "each agent runs attribution" in notes


def test_with_the_aggregator_the_agents_forward_and_it_analyzes(monkeypatch):
    monkeypatch.setenv("NODE_NAME", "gpu-node-1")
    manifests, notes = render({"aggregator": {"enabled": True, "security": {"tokenSecret": "agg-token"}},
                               "attribution": {"settings": {"slowdown_ratio": 2.0}}})
    configs = _configs(manifests)
    agent, agg = configs[f"{RELEASE}-otel-gpu-agent"], configs[f"{RELEASE}-otel-gpu-aggregator"]
    for signal in ("traces", "metrics", "logs"):
        assert agent["service"]["pipelines"][signal]["processors"] == ["memory_limiter"]
        assert "otlp/aggregator" in agent["service"]["pipelines"][signal]["exporters"]
        assert agg["service"]["pipelines"][signal]["processors"] == ["memory_limiter", "attribution", "goodput"]
    assert "attribution" not in agent["processors"] and agg["processors"]["attribution"] == {"slowdown_ratio": 2.0}
    for name, cfg in configs.items():
        load_text(yaml.safe_dump(cfg), name)
    assert f"exec deploy/{RELEASE}-otel-gpu-aggregator -- otel-gpu report" in notes


def test_analysis_can_be_turned_off_and_notes_say_so():
    manifests, notes = render({"attribution": {"enabled": False}, "goodput": {"enabled": False},
                               "memoryLimiter": {"enabled": False}})
    cfg = _agent_config(manifests)
    assert all("processors" not in p for p in cfg["service"]["pipelines"].values()) and not cfg["processors"]
    assert "Attribution and goodput are off" in notes


def test_extra_processors_come_after_the_built_in_ones(monkeypatch):
    monkeypatch.setenv("NODE_NAME", "gpu-node-1")
    extra = [{"name": "compact", "settings": {"job_id": "j-1"}}]
    manifests, _ = render({"agent": {"extraProcessors": extra}, "aggregator": {"enabled": False}})
    cfg = _agent_config(manifests)
    for pipeline in cfg["service"]["pipelines"].values():
        assert pipeline["processors"] == ["memory_limiter", "attribution", "goodput", "compact"]
    assert cfg["processors"]["compact"] == {"job_id": "j-1"}
    load_text(yaml.safe_dump(cfg), "agent with extraProcessors")
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError, match="memory_limiter is already in every pipeline"):
            chart.render({"agent": {"extraProcessors": [{"name": "memory_limiter"}]}}, name=RELEASE,
                         namespace=NAMESPACE)


def test_readme_examples_that_add_processors_keep_the_memory_limiter(monkeypatch):
    """Every example of the README's "Adding processors" renders to pipelines that start with memory_limiter and
    still run attribution and goodput."""
    from otel_gpu.collector.registry import known_types

    monkeypatch.setenv("NODE_NAME", "gpu-node-1")
    text = (CHART / "README.md").read_text(encoding="utf-8")
    part = text.split("### Adding processors", 1)[1].split("\n## ", 1)[0]
    examples = [yaml.safe_load(block.split("```", 1)[0]) for block in part.split("```yaml\n")[1:]]
    assert len(examples) >= 2
    known = known_types("processor")
    for values in examples:
        cfg = _agent_config(render(values)[0])
        for name, pipeline in cfg["service"]["pipelines"].items():
            assert pipeline["processors"][0] == "memory_limiter", (values, name)
            assert "goodput" in pipeline["processors"], (values, name)
        # batch is the Collector's processor; it is registered where this branch meets the config work (issue 13)
        cfg["processors"] = {k: v for k, v in cfg["processors"].items() if k.split("/")[0] in known}
        for pipeline in cfg["service"]["pipelines"].values():
            pipeline["processors"] = [p for p in pipeline["processors"] if p in cfg["processors"]]
        load_text(yaml.safe_dump(cfg), "README example")


# The container runtime, not otel-gpu, reads these: the NVIDIA container toolkit mounts the GPUs and libnvidia-ml.
RUNTIME_ENV = {"NVIDIA_VISIBLE_DEVICES", "NVIDIA_DRIVER_CAPABILITIES"}


def _source_text() -> str:
    return "\n".join(p.read_text(encoding="utf-8") for p in source_files())


def test_the_chart_sets_only_environment_variables_that_are_read():
    """Each variable in an otel-gpu container is read by the collector config (${env:X}), by otel-gpu's code, or by
    the NVIDIA runtime; each variable of the training-env ConfigMap is one the instrumentation reads."""
    source = _source_text()
    for label, values in VALUE_SETS.items():
        manifests, _ = render(values)
        configs = "\n".join(cm["data"]["config.yaml"] for cm in find(manifests, "ConfigMap")
                            if "config.yaml" in cm.get("data", {}))
        user_set = {e["name"] for part in ("agent", "aggregator")
                    for e in values.get(part, {}).get("extraEnv", [])}
        for w in find(manifests, "DaemonSet") + find(manifests, "Deployment"):
            for container in w["spec"]["template"]["spec"]["containers"]:
                for env in container.get("env", []):
                    name = env["name"]
                    if name in user_set or name in RUNTIME_ENV:
                        continue
                    assert f"${{env:{name}}}" in configs or f'"{name}"' in source, \
                        f"{label}: {w['metadata']['name']} sets {name}, which nothing reads"
        user_extra = set(values.get("trainingEnv", {}).get("extra", {}))
        for cm in find(manifests, "ConfigMap", f"{RELEASE}-otel-gpu-training-env"):
            for name in set(cm["data"]) - user_extra:
                assert f'"{name}"' in source, f"{label}: the training-env ConfigMap sets {name}, which nothing reads"


@pytest.mark.parametrize("values,key", [
    ({"agnet": {"enabled": True}}, "agnet"),
    ({"image": {"tags": "1"}}, "tags"),
    ({"agent": {"receivers": {"nvml": {"setings": {}}}}}, "setings"),
    ({"aggregator": {"security": {"tls": "x"}}}, "tls"),
    ({"attribution": {"enable": False}}, "enable"),
    ({"agent": {"resources": {"limit": {"cpu": "1"}}}}, "limit"),
    ({"agent": {"extraProcessors": [{"name": "batch", "setting": {}}]}}, "setting"),
    ({"serviceMonitor": {"intervals": "5s"}}, "intervals"),
])
def test_values_schema_refuses_unknown_keys(values, key):
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError, match=key):
            chart.render(values, name=RELEASE, namespace=NAMESPACE)


def test_values_schema_closes_every_object_of_the_chart():
    """additionalProperties is false on every object the chart defines; only maps passed on as they are stay open
    (collector settings/config, which otel-gpu's validator checks; Kubernetes objects, which the API server checks)."""
    import json

    schema = json.loads((CHART / "values.schema.json").read_text(encoding="utf-8"))
    passthrough = {"settings", "config", "podSecurityContext", "securityContext", "affinity", "global", "podSelector",
                   "namespaceSelector", "metricsFrom[]", "aggregatorExtraFrom[]", "from[]"}
    open_paths = []

    def walk(node: dict, path: str) -> None:
        if node.get("type") == "object" or "properties" in node:
            if node.get("additionalProperties", True) is True and path.rsplit(".", 1)[-1] not in passthrough:
                open_paths.append(path or "<root>")
        for key, child in node.get("properties", {}).items():
            walk(child, f"{path}.{key}" if path else key)
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(schema, "")
    assert not open_paths, f"objects that accept unknown keys: {open_paths}"
    render({"global": {"imageRegistry": "r"}})  # a parent chart's globals are allowed


# -- trust (docs/security.md) ----------------------------------------------------------------------------------------
def _volume_path(manifests: list[dict], kind: str, name: str, secret: str) -> str:
    """Where the pod of ``kind``/``name`` mounts the Secret ``secret``."""
    pod = one(manifests, kind, name)["spec"]["template"]["spec"]
    volume = next(v["name"] for v in pod["volumes"] if v.get("secret", {}).get("secretName") == secret)
    return next(m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == volume)


def test_the_aggregator_without_a_token_is_refused_unless_the_operator_says_so_and_then_notes_warn():
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError, match="aggregator.security.tokenSecret"):
            chart.render({"aggregator": {"enabled": True}}, name=RELEASE, namespace=NAMESPACE)
    _, notes = render({"aggregator": {"enabled": True, "security": {"allowUnauthenticated": True}}})
    assert "WARNING: the aggregator takes OTLP without a token" in notes
    _, notes = render({"aggregator": {"enabled": True, "security": {"tokenSecret": "t"}}})
    assert "WARNING: the aggregator" not in notes
    # mutual TLS authenticates the agents too
    render({"aggregator": {"enabled": True, "security": {"tlsSecret": "tls", "mutualTls": True}}})


def test_network_policies_admit_otlp_only_from_training_pods_into_agents_and_only_from_agents_into_the_aggregator():
    manifests, notes = render(FULL_VALUES)
    agent_np = one(manifests, "NetworkPolicy", f"{RELEASE}-otel-gpu-agent")
    agg_np = one(manifests, "NetworkPolicy", f"{RELEASE}-otel-gpu-aggregator")
    agent_pod = one(manifests, "DaemonSet")["spec"]["template"]
    agg_pod = one(manifests, "Deployment")["spec"]["template"]
    # each policy selects its own pods
    for np, pod in ((agent_np, agent_pod), (agg_np, agg_pod)):
        assert np["spec"]["policyTypes"] == ["Ingress"]
        assert np["spec"]["podSelector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    containers = {"agent": agent_pod["spec"]["containers"][0], "aggregator": agg_pod["spec"]["containers"][0]}
    for role, np in (("agent", agent_np), ("aggregator", agg_np)):
        otlp_rule, metrics_rule = np["spec"]["ingress"]
        otlp_ports = {p["port"] for p in otlp_rule["ports"]}
        assert otlp_ports == {container_port(containers[role], "otlp-grpc"), container_port(containers[role],
                                                                                            "otlp-http")}
        assert [p["port"] for p in metrics_rule["ports"]] == [container_port(containers[role], "metrics")]
        assert "from" not in metrics_rule  # Prometheus and the kubelet's probes: from anywhere by default
        assert otlp_rule["from"], "an OTLP rule without `from` would admit every pod"
    assert agent_np["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {"otel-gpu/send": "true"}},
                                                       "namespaceSelector": {}}]
    assert agg_np["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"].items() <= \
        agent_pod["metadata"]["labels"].items()
    assert "otel-gpu/send" in notes  # the label a training pod needs is in the instructions
    narrowed = render({"networkPolicy": {"trainingPods": {"namespaceSelector": {"matchLabels": {"team": "ml"}}},
                                         "metricsFrom": [{"namespaceSelector": {"matchLabels": {"name": "mon"}}}]}})
    np = one(narrowed[0], "NetworkPolicy", f"{RELEASE}-otel-gpu-agent")
    assert np["spec"]["ingress"][0]["from"][0]["namespaceSelector"] == {"matchLabels": {"team": "ml"}}
    assert np["spec"]["ingress"][1]["from"] == [{"namespaceSelector": {"matchLabels": {"name": "mon"}}}]
    off, notes = render({"networkPolicy": {"enabled": False}})
    assert not find(off, "NetworkPolicy") and "WARNING: networkPolicy.enabled is false" in notes


def test_agent_token_guards_the_agents_otlp_and_training_pods_get_it_from_the_secret_not_the_configmap():
    manifests, notes = render(FULL_VALUES)
    cfg = _agent_config(manifests)
    path = _volume_path(manifests, "DaemonSet", f"{RELEASE}-otel-gpu-agent", "agent-token")
    for proto in ("grpc", "http"):
        assert cfg["receivers"]["otlp"][proto]["auth"] == {"bearer_token_file": f"{path}/token"}
    assert "secretKeyRef: {name: agent-token, key: token}" in notes
    assert "authorization=Bearer $(OTEL_GPU_AGENT_TOKEN)" in notes
    for env in find(manifests, "ConfigMap", f"{RELEASE}-otel-gpu-training-env"):
        assert not [k for k in env["data"] if "TOKEN" in k or k == "OTEL_EXPORTER_OTLP_HEADERS"], env["data"]
    default_cfg = _agent_config(render({})[0])
    assert "auth" not in default_cfg["receivers"]["otlp"]["grpc"]  # off by default (the NetworkPolicy still applies)


def test_a_token_in_the_training_environment_is_refused():
    with helm.Chart.load(str(CHART)) as chart:
        for extra in ({"OTEL_GPU_VERDICT_TOKEN": "s3cret"}, {"OTEL_GPU_FORWARDER_TOKEN": "s3cret"},
                      {"OTEL_EXPORTER_OTLP_HEADERS": "authorization=Bearer s3cret"}):
            with pytest.raises(helm.HelmError, match="trainingEnv.extra"):
                chart.render({"trainingEnv": {"extra": extra}}, name=RELEASE, namespace=NAMESPACE)


def test_trusted_forwarders_token_is_trusted_by_agents_and_aggregator_and_presented_by_the_agents(monkeypatch):
    manifests, _ = render(FULL_VALUES)
    agent = _agent_config(manifests)
    agg = yaml.safe_load(one(manifests, "ConfigMap", f"{RELEASE}-otel-gpu-aggregator")["data"]["config.yaml"])
    agent_path = _volume_path(manifests, "DaemonSet", f"{RELEASE}-otel-gpu-agent", "forwarder-token")
    agg_path = _volume_path(manifests, "Deployment", f"{RELEASE}-otel-gpu-aggregator", "forwarder-token")
    assert agent["receivers"]["otlp"]["trusted_forwarders"] == {"bearer_token_file": f"{agent_path}/token"}
    assert agg["receivers"]["otlp"]["trusted_forwarders"] == {"bearer_token_file": f"{agg_path}/token"}
    # the forwarder token also passes the aggregator's auth, so the agents present it instead of the plain token
    assert agent["exporters"]["otlp/aggregator"]["auth"] == {"bearer_token_file": f"{agent_path}/token"}
    for text in (agent, agg):  # and our own validator takes both configs
        monkeypatch.setenv("NODE_NAME", "node-1")
        load_text(yaml.safe_dump(text), "rendered")
    plain = _agent_config(render({})[0])
    assert "trusted_forwarders" not in plain["receivers"]["otlp"]


FAILOVER_VALUES: dict[str, Any] = {"aggregator": {"enabled": True, "security": {"tokenSecret": "agg-token"},
                                                  "verdict": {"enabled": True, "tokenSecret": "verdict-token"}}}


def test_the_aggregator_can_serve_the_verdict_and_jobs_api_for_failover_across_nodes(monkeypatch):
    """Issue 19: each node's otel-gpu run reaches the aggregator's verdict API (decisions of the job), with a token,
    from the training pods only; the aggregator runs health (drained devices)."""
    monkeypatch.setenv("NODE_NAME", "gpu-node-1")
    manifests, notes = render(FAILOVER_VALUES)
    assert f"--verdict-url http://{RELEASE}-otel-gpu-aggregator.{NAMESPACE}.svc:4319" in notes
    for m in manifests:
        kubernetes_validate.validate({k: v for k, v in m.items() if k != "__template__"}, KUBE, strict=True)
    agg = _configs(manifests)[f"{RELEASE}-otel-gpu-aggregator"]
    load_text(yaml.safe_dump(agg), "aggregator")
    verdict = agg["exporters"]["verdict"]
    assert verdict["endpoint"] == "0.0.0.0:4319"
    assert verdict["auth"] == {"bearer_token_file": "/var/run/secrets/otel-gpu/verdict/token"}
    assert "verdict" in agg["service"]["pipelines"]["logs"]["exporters"]
    for signal in ("metrics", "logs"):
        assert agg["service"]["pipelines"][signal]["processors"][-1] == "health"
    deploy = one(manifests, "Deployment", f"{RELEASE}-otel-gpu-aggregator")
    container = deploy["spec"]["template"]["spec"]["containers"][0]
    assert container_port(container, "verdict") == 4319
    mounts = {v["mountPath"]: v["name"] for v in container["volumeMounts"]}
    assert mounts["/var/run/secrets/otel-gpu/verdict"] == "verdict-token"
    service = one(manifests, "Service", f"{RELEASE}-otel-gpu-aggregator")
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]}["verdict"] == 4319
    policy = one(manifests, "NetworkPolicy", f"{RELEASE}-otel-gpu-aggregator")
    rule = next(r for r in policy["spec"]["ingress"] if r["ports"][0]["port"] == 4319)
    assert rule["from"][0]["podSelector"] == {"matchLabels": {"otel-gpu/send": "true"}}
    with helm.Chart.load(str(CHART)) as chart:
        with pytest.raises(helm.HelmError, match="aggregator.verdict.tokenSecret"):
            chart.render({"aggregator": {"enabled": True, "security": {"tokenSecret": "t"},
                                         "verdict": {"enabled": True}}}, name=RELEASE, namespace=NAMESPACE)
        with pytest.raises(helm.HelmError, match="replicas: 1"):
            chart.render({"aggregator": {"enabled": True, "replicas": 2, "security": {"tokenSecret": "t"},
                                         "verdict": {"enabled": True, "tokenSecret": "v"}}},
                         name=RELEASE, namespace=NAMESPACE)
