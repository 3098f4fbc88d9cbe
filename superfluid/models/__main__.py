"""`python -m superfluid.models`: fetch the models the test suite uses."""

from __future__ import annotations

from ._files import default_model_path, gemma_test_model_path

print(default_model_path())
print(gemma_test_model_path())
