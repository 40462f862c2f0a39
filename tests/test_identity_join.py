"""Identity joins (issue 10): what the user set wins; GPUs are named by UUID so the collector can join them with NVML.

On Kubernetes the training pod's host name is the pod's, while the node agent names GPUs and NICs by node: the chart
tells users to set ``host.name`` from the Downward API (spec.nodeName), and that value must survive.
"""
from __future__ import annotations

import socket
import sys
import types

import pytest

from otel_gpu.instrumentation._identity import (DEFAULT_SERVICE_NAME, Identity, nvml_index_from_visible_devices,
                                                uuid_from_visible_devices)
from otel_gpu.instrumentation.config import InstrumentationConfig


def identity_from_env(env: dict[str, str]) -> dict[str, object]:
    cfg = InstrumentationConfig.from_env(env)
    return Identity("job-1", cfg.service_name, cfg.resource_attributes).attributes()


def test_user_set_host_and_service_names_are_never_overwritten():
    attrs = identity_from_env({"OTEL_RESOURCE_ATTRIBUTES": "host.name=gpu-node-7,service.name=llama,team=ml"})
    assert (attrs["host.name"], attrs["service.name"], attrs["team"]) == ("gpu-node-7", "llama", "ml")


def test_otel_service_name_wins_over_resource_attributes_as_in_the_otel_sdk():
    attrs = identity_from_env({"OTEL_SERVICE_NAME": "pretrain", "OTEL_RESOURCE_ATTRIBUTES": "service.name=llama"})
    assert attrs["service.name"] == "pretrain"


def test_defaults_without_user_settings():
    attrs = identity_from_env({})
    assert attrs["host.name"] == socket.gethostname() and attrs["service.name"] == DEFAULT_SERVICE_NAME


def test_k8s_node_name_is_the_host_when_host_name_is_not_given():
    attrs = identity_from_env({"OTEL_RESOURCE_ATTRIBUTES": "k8s.node.name=gpu-node-3,k8s.pod.name=trainer-0"})
    assert attrs["host.name"] == "gpu-node-3" and attrs["k8s.pod.name"] == "trainer-0"


def test_no_gpu_attributes_on_cpu():
    import torch

    ident = Identity("job-1", None, {})
    assert not torch.cuda.is_initialized()
    assert ident.refresh_gpu() is False
    assert "gpu.uuid" not in ident.attributes() and "gpu.index" not in ident.attributes()


class _FakeCuda:
    def __init__(self, uuid, device=1):
        self._uuid, self._device = uuid, device

    def is_initialized(self):
        return True

    def current_device(self):
        return self._device

    def get_device_properties(self, index):
        assert index == self._device
        return types.SimpleNamespace(uuid=self._uuid, name="NVIDIA H100 80GB HBM3")


@pytest.mark.parametrize("uuid, visible, want_uuid, want_index", [
    ("8a1c7b2e-57a5-4c4e-9f7e-0d7a3b1c2d3e", "4,5", "GPU-8a1c7b2e-57a5-4c4e-9f7e-0d7a3b1c2d3e", 5),
    (bytes(range(1, 17)), None, "GPU-01020304-0506-0708-090a-0b0c0d0e0f10", 1),
    (None, "GPU-aaaa,GPU-bbbb", "GPU-bbbb", 1),  # an old torch without .uuid: the container runtime's list names it
    ("00000000-0000-0000-0000-000000000000", None, None, 1),  # no UUID is no UUID
])
def test_cuda_device_uuid_once_the_program_started_cuda(monkeypatch, uuid, visible, want_uuid, want_index):
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=_FakeCuda(uuid)))
    ident = Identity("job-1", None, {})
    before = ident.version
    assert ident.refresh_gpu() is True and ident.version == before + 1
    attrs = ident.attributes()
    assert attrs.get("gpu.uuid") == want_uuid and attrs["gpu.index"] == want_index
    assert ident.refresh_gpu() is False  # unchanged: encoders keep their cached resource


def test_a_broken_cuda_is_not_an_error(monkeypatch):
    class Broken(_FakeCuda):
        def get_device_properties(self, index):
            raise RuntimeError("CUDA driver error: unknown error")

    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(cuda=Broken("x")))
    ident = Identity("job-1", None, {})
    assert ident.refresh_gpu() is False and "gpu.uuid" not in ident.attributes()


def test_visible_devices_translation():
    assert nvml_index_from_visible_devices(0, "3") == 3
    assert nvml_index_from_visible_devices(2, "3") == 2  # out of range: the CUDA index is all there is
    assert nvml_index_from_visible_devices(0, "GPU-x") == 0
    assert uuid_from_visible_devices(0, "MIG-1/2/3") == "MIG-1/2/3"
    assert uuid_from_visible_devices(0, "0,1") is None


def test_helm_chart_names_the_node_through_the_downward_api():
    """The node agent's receivers name the node (host_name from spec.nodeName); the notes tell training pods to set
    host.name the same way, since a ConfigMap cannot carry a fieldRef."""
    helm = pytest.importorskip("helm_python", reason="helm-python-sdk is in the test extra")
    import yaml
    from pathlib import Path

    chart = Path(__file__).resolve().parents[1] / "helm" / "otel-gpu"
    with helm.Chart.load(str(chart)) as loaded:
        out = loaded.render({}, name="rel", namespace="mon")
    docs = [d for path, text in out.items() if not path.endswith("NOTES.txt") for d in yaml.safe_load_all(text) if d]
    notes = next(text for path, text in out.items() if path.endswith("NOTES.txt"))
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    env = {e["name"]: e for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    config = next(yaml.safe_load(d["data"]["config.yaml"]) for d in docs
                  if d["kind"] == "ConfigMap" and "config.yaml" in d.get("data", {}))
    for receiver in ("nvml", "nic"):
        assert config["receivers"][receiver]["host_name"] == "${env:NODE_NAME}"
    assert "fieldPath: spec.nodeName" in notes and "host.name=$(NODE_NAME)" in notes


def test_the_job_network_interfaces_are_on_the_resource(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")
    monkeypatch.setenv("NCCL_IB_HCA", "^mlx5_2,=mlx5_0:1")
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    assert Identity("job-1", None, {}).attributes()["training.net.interfaces"] == "eth1,=mlx5_0:1"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.delenv("NCCL_IB_HCA")
    assert "training.net.interfaces" not in Identity("job-1", None, {}).attributes()
