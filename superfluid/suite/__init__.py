"""The serving-semantics suite: eight scenarios against any server.

``python -m superfluid.suite run --systems superfluid-mock --scale quick``
starts each system itself (or attaches to ``--url``), runs the scenarios and
writes one JSON result per (scenario, system); ``compare DIR`` renders them.
It talks to servers only over HTTP on loopback, and through signals to the
process groups it started.
"""

from __future__ import annotations

from ._cli import main
from ._client import Client, metric_sum
from ._compare import compare, load_results
from ._conditions import CHECKS, CONDITIONS, Check, judge, prefix_prefills
from ._corpus import QUESTIONS, SCALES, Scale, document, percentile
from ._process import Context, ScenarioError, Server, StartFailed, Target
from ._reply import TYPED, UNTYPED, Reply, StreamReader, read_whole
from ._runner import SCENARIOS, RunOptions, run
from ._systems import Box, Caps, SystemSpec, load_box, system_spec

__all__ = [
    "CHECKS", "CONDITIONS", "QUESTIONS", "SCALES", "SCENARIOS", "TYPED", "UNTYPED", "Box", "Caps", "Check",
    "Client", "Context", "Reply", "RunOptions", "Scale", "ScenarioError", "Server", "StartFailed",
    "StreamReader", "SystemSpec", "Target", "compare", "document", "judge", "load_box", "load_results", "main",
    "metric_sum", "percentile", "prefix_prefills", "read_whole", "run", "system_spec",
]
