"""The worker side: the process entry point, the generic executor and the
primitive runtimes (mock, llama.cpp). The daemon never imports this package's
runtime modules; it only starts ``python -m superfluid.worker``."""

from __future__ import annotations
