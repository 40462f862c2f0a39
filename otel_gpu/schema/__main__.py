import sys

from otel_gpu.schema import render_markdown

sys.stdout.write(render_markdown())
