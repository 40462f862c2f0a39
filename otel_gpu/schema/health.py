"""Device health (processor: health): per-device state and score, state-change events, and the device identity
that ties them to failures across jobs and collector restarts.

A device is a GPU (keyed by its UUID), a node (its host name) or a NIC port (host, device and port). Its stable id
(:data:`DEVICE_ID`) is ``gpu:<uuid>``, ``node:<host>`` or ``nic:<host>/<device>[/<port>]``.

Example:
    >>> from otel_gpu.schema import health
    >>> health.HEALTH.name, health.HEALTH.prometheus_name
    ('otel_gpu.device.health', 'otel_gpu_device_health')
    >>> [s.value for s in health.DeviceState]
    ['healthy', 'watch', 'drain']
    >>> health.device_id(health.DeviceKind.GPU, uuid="GPU-1234")
    'gpu:GPU-1234'
"""
from __future__ import annotations

import enum

from otel_gpu.schema._model import MetricType, attr, enumeration, event, metric
from otel_gpu.schema.identity import HOST_NAME

_G = "Device health"


@enumeration
class DeviceState(str, enum.Enum):
    """What to do with a device: keep it, keep an eye on it, or take it out of the next job."""

    HEALTHY = "healthy"
    WATCH = "watch"
    DRAIN = "drain"


@enumeration
class DeviceKind(str, enum.Enum):
    GPU = "gpu"
    NODE = "node"
    NIC_PORT = "nic_port"


#: Order of severity (a device's state is the most severe of its rules).
STATE_RANK = {DeviceState.HEALTHY: 0, DeviceState.WATCH: 1, DeviceState.DRAIN: 2}

DEVICE_ID = attr("otel_gpu.device.id", "string", "Stable device id: gpu:<uuid>, node:<host> or "
                 "nic:<host>/<device>[/<port>]; the key of the store's device history.", group=_G)
DEVICE_KIND = attr("otel_gpu.device.kind", "string", "gpu, node or nic_port.", group=_G, values=DeviceKind)
DEVICE_STATE = attr("otel_gpu.device.state", "string", "healthy, watch or drain.", group=_G, values=DeviceState)
DEVICE_RULE = attr("otel_gpu.device.health.rule", "string", "The scoring rule that decided the state (e.g. "
                   "ecc_corrected_rate, nic_link_flaps); see processors/health/README.md.", group=_G)

_DEVICE_ATTRS = (DEVICE_ID, DEVICE_KIND, HOST_NAME)

HEALTH = metric("otel_gpu.device.health", MetricType.GAUGE, "{flag}",
                "1 for the device's current health state (otel_gpu.device.state), 0 for the others.", group=_G,
                attributes=_DEVICE_ATTRS + (DEVICE_STATE,))
HEALTH_SCORE = metric("otel_gpu.device.health.score", MetricType.GAUGE, "{score}",
                      "Risk score 0..100 (sum of the weights of the rules that hold; 0 healthy); the state comes "
                      "from the rules' severities, the score orders devices within a state.", group=_G,
                      attributes=_DEVICE_ATTRS)
STATE_CHANGE_EVENT = event("otel_gpu.device.state_change", "A device changed health state (or was first seen). "
                           "Severity WARN for watch, ERROR for drain, INFO otherwise; the store keeps it.", group=_G,
                           attributes=_DEVICE_ATTRS + (DEVICE_STATE, DEVICE_RULE),
                           body="{device_id, kind, host, uuid, serial, gpu_index, pci_bus_id, port, guid, state, "
                                "previous, score, since, time, evidence: [text], rules: [name]}")

METRICS = (HEALTH, HEALTH_SCORE)


def device_id(kind: DeviceKind | str, *, host: str | None = None, uuid: str | None = None,
              port: str | None = None) -> str:
    """The stable id of a device (see :data:`DEVICE_ID`)."""
    kind = DeviceKind(kind)
    if kind is DeviceKind.GPU:
        return f"gpu:{uuid}" if uuid else f"gpu:{host}/unknown"
    if kind is DeviceKind.NODE:
        return f"node:{host}"
    return f"nic:{host}/{port}"
