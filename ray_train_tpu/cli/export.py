"""``export``: a checkpoint -> a Hugging Face model directory (`ray_train_tpu.checkpoint.export_hf`)."""

from __future__ import annotations

import argparse
from typing import Callable, TextIO

ORDER = 60
EXAMPLE = ("python -m ray_train_tpu export /shared/ckpt/step_000100 --base-model /shared/models/SmolLM2-135M-Instruct "
           "--dest gs://my-bucket/models/smollm2-ft")
_DTYPES = ("float32", "bfloat16", "float16")


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of MiB >= 1, e.g. 1024")
    return int(text)


def _export(args: argparse.Namespace, out: TextIO) -> int:
    from ray_train_tpu.checkpoint.export import ExportError, export_hf

    from ray_train_tpu.cli import RunFailed, running

    try:
        with running(f"export of {args.checkpoint}"):
            info = export_hf(args.checkpoint, args.base_model, args.dest, args.overwrite, dtype=args.dtype,
                             max_file_bytes=args.max_file_mib << 20)
    except RunFailed as e:
        if isinstance(e.__cause__, (ExportError, TypeError)):  # refused before writing: bad input
            raise e.__cause__ from None
        raise
    out.write(f"exported step {info.step} (written by {info.world_size} ranks) to {info.dest}: "
              f"{info.num_tensors} tensors, {info.num_bytes / 2**20:.1f} MiB {info.dtype} in {len(info.files)} "
              f"file(s), {info.seconds:.1f} s\n")
    return 0


def register(subparsers, add_slice_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add ``export`` to ``python -m ray_train_tpu``."""
    p = subparsers.add_parser(
        "export", help="export a checkpoint's model as a Hugging Face directory (safetensors + the base "
        "model's config and tokenizer) for transformers, vLLM and Ray Serve LLM")
    p.add_argument("checkpoint", help="a complete checkpoint directory (from ray_train_tpu.checkpoint.save/report)")
    p.add_argument("--base-model", required=True,
                   help="the local Hugging Face directory the run started from (names, shapes, config, tokenizer)")
    p.add_argument("--dest", required=True, help="output directory: a path or a URI (gs://, s3://, file://...)")
    p.add_argument("--overwrite", action="store_true", help="replace the contents of a non-empty destination")
    p.add_argument("--dtype", choices=_DTYPES, help="cast the weights (default: the checkpoint's dtype)")
    p.add_argument("--max-file-mib", type=_positive_int, default=1024,
                   help="largest safetensors file in MiB; peak memory grows by about 3 times this (default 1024)")
    p.set_defaults(func=_export)
