"""Model files: resolving a model argument, naming models, the embedded default and the test models."""

from __future__ import annotations

from ._files import DEFAULT_MODEL_FILE, cache_dir, default_model_path, gemma_test_model_path, model_name, resolve_runtime

__all__ = ["DEFAULT_MODEL_FILE", "cache_dir", "default_model_path", "gemma_test_model_path", "model_name",
           "resolve_runtime"]
