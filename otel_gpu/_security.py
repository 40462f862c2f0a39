"""Old name of :mod:`otel_gpu.security`, kept so that code written against it still imports."""
from otel_gpu.security import *  # noqa: F401,F403
