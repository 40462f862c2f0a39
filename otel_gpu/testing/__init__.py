"""Fakes and fixtures that the product's own config can select (fake NVML, fake sysfs) and test peers (an OTLP sink).

No product module imports this package unless its config asks for a fake backend.
"""
