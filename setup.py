"""Maps the top-level ``receivers/`` and ``processors/`` folders into the ``otel_gpu`` namespace.

The design card keeps one folder per component at the repository's top level, but nothing named plain
``receivers`` or ``processors`` may land in site-packages; this is the one place that knows the mapping.
"""
from setuptools import find_packages, setup

_MAPPED = {"otel_gpu.receivers": "receivers", "otel_gpu.processors": "processors"}

packages = find_packages(include=["otel_gpu", "otel_gpu.*"])
package_dir = {"otel_gpu": "otel_gpu"}
for name, folder in _MAPPED.items():
    packages.append(name)
    packages += [f"{name}.{sub}" for sub in find_packages(where=folder)]
    package_dir[name] = folder

setup(packages=packages, package_dir=package_dir)
